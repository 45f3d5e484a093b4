"""`mstrace bench-serve` as a user runs it: without its extra, and against a server of
another framing than mstrace's own."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.support.cli import REPO, mstrace


def _without_aiohttp(*args: str) -> subprocess.CompletedProcess[str]:
    # None in sys.modules makes `import aiohttp` raise ModuleNotFoundError, as an absent package does
    code = ("import sys; sys.modules['aiohttp'] = None; "
            f"sys.argv = ['mstrace', 'bench-serve', *{list(args)!r}]; "
            "from viewer.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_without_aiohttp_bench_serve_names_the_extra_and_exits_2() -> None:
    # the port is one nothing listens on: the error must come before any request is tried
    p = _without_aiohttp("--base-url", "http://127.0.0.1:9", "--model", "tiny", "--num-prompts", "1")
    assert p.returncode == 2, p.stderr
    assert "pip install 'mstrace[bench]'" in p.stderr and "aiohttp" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert p.stdout == ""


def test_without_aiohttp_bench_serve_still_has_its_help() -> None:
    p = _without_aiohttp("--help")
    assert p.returncode == 0 and "--base-url" in p.stdout, p.stderr


class CrlfServer:
    """A loopback OpenAI-style server on raw sockets that frames its SSE as sse-starlette
    does (CRLF) and then some: `data:` without a space, comment pings, `id:` lines, one
    JSON object over two `data:` lines, and every event written in pieces cut mid-line
    (one piece ending in the CR whose LF starts the next). Keep-alive, chunked bodies.
    With `stall`, it sends the head and a ping, then nothing."""

    def __init__(self, count: Callable[[str], int], stall: bool = False, odd: str = "") -> None:
        self.count, self.stall, self.odd = count, stall, odd
        self.bodies: list[dict[str, Any]] = []  # as they came
        self.connections = self.requests = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(started,), daemon=True)
        self.thread.start()
        started.wait(30)

    def _main(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return  # the client closed its connection
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split()[1]
                fields = dict(h.split(": ", 1) for h in lines[1:] if ": " in h)
                n = int({k.lower(): v for k, v in fields.items()}.get("content-length", "0"))
                body = json.loads(await reader.readexactly(n)) if n else {}
                self.bodies.append(body)
                self.requests += 1
                await self._answer(writer, path, body)
        finally:
            writer.close()

    async def _piece(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.002)  # so the pieces usually reach the client apart (no assert relies on it)

    async def _answer(self, writer: asyncio.StreamWriter, path: str, body: dict[str, Any]) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                     b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
        await self._piece(writer, b": ping - 2026-12-02 12:00:00\r\n\r\n")
        if self.stall:
            await asyncio.sleep(3600)
        chat = path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        rid, n = f"cmpl-{self.requests}", int(body["max_tokens"])
        if self.odd:
            await self._odd(writer, rid, n, chat)
            return
        for i in range(n):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
            choice.update({"delta": {"content": f"w{i} "}} if chat else {"text": f"w{i} "})
            first, rest = json.dumps({"id": rid, "choices": [choice]}).split(", ", 1)
            event = f"id: {i}\r\ndata:{first},\r\ndata:{rest}\r\n: between\r\n\r\n".encode()
            cr = event.index(b"\r")
            for a, b in ((0, cr + 1), (cr + 1, cr + 5), (cr + 5, len(event))):
                await self._piece(writer, event[a:b])
        usage = {"prompt_tokens": self.count(prompt), "completion_tokens": n,
                 "total_tokens": self.count(prompt) + n}
        await self._piece(writer, f"data:{json.dumps({'id': rid, 'choices': [], 'usage': usage})}\r\n\r".encode())
        await self._piece(writer, b"\ndata:[DONE]\r\n\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


    async def _odd(self, writer: asyncio.StreamWriter, rid: str, n: int, chat: bool) -> None:
        """`shape`: a chunk whose choices are not objects (on the first request only);
        `error`: an error object then [DONE], as vLLM and SGLang end a failed stream;
        `nousage`: chat's role chunk, n tokens, an empty finish chunk, and no usage."""
        def ev(obj: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(obj)}\r\n\r\n".encode()

        if self.odd == "shape" and self.requests == 1:
            await self._piece(writer, ev({"id": rid, "choices": ["x"]}))
        elif self.odd == "error":
            await self._piece(writer, ev({"error": {"message": "boom", "type": "InternalServerError"}}))
        else:
            choices: list[dict[str, Any]] = [{"index": 0, "delta": {"role": "assistant", "content": ""}}] if chat else []
            choices += [{"index": 0, **({"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}),
                         "finish_reason": None} for i in range(n)]
            choices.append({"index": 0, **({"delta": {}} if chat else {"text": ""}), "finish_reason": "length"})
            for c in choices:
                await self._piece(writer, ev({"id": rid, "choices": [c]}))
        await self._piece(writer, b"data: [DONE]\r\n\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@pytest.fixture(scope="module")
def tiny_tok() -> Any:
    """The tiny preset's tokenizer as bench-serve loads it (and counts with it)."""
    from viewer.bench_serve.command import _tokenizer

    def no(*a: object) -> NoReturn:
        raise AssertionError(a)

    return _tokenizer("tiny", no)


@pytest.fixture(scope="module")
def tiny_count(tiny_tok: Any) -> Callable[[str], int]:
    return lambda text: len(tiny_tok.encode(text))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_reads_a_crlf_framed_stream_cut_anywhere(endpoint: str, tiny_count: Callable[[str], int],
                                                          tmp_path: Path) -> None:
    srv = CrlfServer(tiny_count)
    saved = tmp_path / "result.json"
    try:
        p = mstrace("bench-serve", "--base-url", f"http://127.0.0.1:{srv.port}", "--endpoint", endpoint,
                    "--model", "tiny", "--num-prompts", "12", "--random-input-len", "24", "--random-output-len", "6",
                    "--max-concurrency", "3", "--save-result", str(saved), "--save-detailed", timeout=300)
    finally:
        srv.close()
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(saved.read_text())
    assert res["successful_requests"] == 12 and res["failed_requests"] == 0, res["errors"]
    assert res["total_output_tokens"] == 12 * 6
    # one keep-alive pool: never more connections than requests in flight, each reused
    assert srv.requests == 12 and srv.connections <= 3
    for row in res["requests"]:
        assert row["ok"] and row["error"] == ""
        assert row["text"] == "".join(f"w{i} " for i in range(6))
        assert row["chunks"] == row["output_tokens"] == 6
        assert row["prompt_tokens"] == row["input_len"] == 24
        # stamped in arrival order: send <= first chunk <= each next chunk <= [DONE]
        assert row["ttft_ms"] >= 0 and len(row["itl_ms"]) == 5 and min(row["itl_ms"]) >= 0
        assert row["ttft_ms"] + sum(row["itl_ms"]) <= row["e2el_ms"] + 1e-6


def test_a_request_past_its_timeout_fails_and_says_so(tiny_count: Callable[[str], int]) -> None:
    srv = CrlfServer(tiny_count, stall=True)
    try:
        p = mstrace("bench-serve", "--base-url", f"http://127.0.0.1:{srv.port}", "--model", "tiny",
                    "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
                    "--request-timeout", "1", timeout=120)
    finally:
        srv.close()
    assert p.returncode == 4, p.stdout + p.stderr  # no request succeeded
    assert "Failed requests:                        2" in p.stdout
    assert "failed x2: no complete reply within --request-timeout 1 s" in p.stdout


def test_a_bad_request_timeout_is_refused() -> None:
    p = mstrace("bench-serve", "--model", "tiny", "--request-timeout", "0")
    assert p.returncode == 2 and "--request-timeout must be positive" in p.stderr


def _text(p: Any) -> str:
    assert isinstance(p.text, str)  # the random dataset makes text, never token ids
    return p.text


def test_random_prompts_have_the_asked_length_as_the_tokenizer_counts_them(tiny_tok: Any) -> None:
    from viewer.bench_serve.datasets import random_prompts

    # random ids decoded to text used to re-encode to more: 64 asked gave 80-109, 3,797 in all
    exact = random_prompts(40, 64, 16, 0.0, 0, tiny_tok.vocab_size, tiny_tok.encode, tiny_tok.decode, 0)
    assert [len(tiny_tok.encode(p.text)) for p in exact] == [p.input_len for p in exact] == [64] * 40
    assert {p.output_len for p in exact} == {16}
    spread = random_prompts(300, 64, 16, 0.25, 0, tiny_tok.vocab_size, tiny_tok.encode, tiny_tok.decode, 1)
    lens = [len(tiny_tok.encode(p.text)) for p in spread]
    assert lens == [p.input_len for p in spread]
    assert min(lens) >= 48 and max(lens) <= 80 and len(set(lens)) > 20
    assert abs(sum(lens) / len(lens) - 64) < 2  # (seeded: the same draws every run)
    assert all(12 <= p.output_len <= 20 for p in spread)


def test_random_prompts_share_their_prefix_and_count_it(tiny_tok: Any) -> None:
    from viewer.bench_serve.datasets import random_prompts

    ps = random_prompts(30, 50, 8, 0.1, 20, tiny_tok.vocab_size, tiny_tok.encode, tiny_tok.decode, 2)
    assert len(tiny_tok.encode(os.path.commonprefix([_text(p) for p in ps]))) == 20
    assert all(20 + 45 <= len(tiny_tok.encode(p.text)) <= 20 + 55 for p in ps)


def test_random_prompts_count_what_the_tokenizer_adds(tiny_tok: Any) -> None:
    """A server that puts a BOS before each prompt counts it; so does the dataset, given
    that server's encode."""
    from viewer.bench_serve.datasets import random_prompts

    def with_bos(text: str) -> list[int]:
        return [1, *tiny_tok.encode(text)]

    ps = random_prompts(20, 32, 8, 0.0, 0, tiny_tok.vocab_size, with_bos, tiny_tok.decode, 3)
    assert {len(with_bos(_text(p))) for p in ps} == {p.input_len for p in ps} == {32}


def test_a_bad_range_ratio_is_refused() -> None:
    p = mstrace("bench-serve", "--model", "tiny", "--random-range-ratio", "1")
    assert p.returncode == 2 and "--random-range-ratio must be in [0, 1)" in p.stderr


@pytest.mark.parametrize("odd", ["shape", "error", "nousage"])
def test_odd_replies_fail_with_their_reason_or_are_counted_by_their_text(odd: str, tiny_tok: Any,
                                                                        tiny_count: Callable[[str], int],
                                                                        tmp_path: Path) -> None:
    """A chunk of another shape is that request's failure, not the run's traceback (every
    result was lost); an error object then [DONE] is a failure with its message, not a
    success of 0 tokens; without usage, output tokens are the text's tokens (chunks counted
    chat's role chunk and the empty finish chunk as tokens)."""
    srv = CrlfServer(tiny_count, odd=odd)
    saved = tmp_path / "r.json"
    try:
        p = mstrace("bench-serve", "--base-url", f"http://127.0.0.1:{srv.port}", "--endpoint", "chat",
                    "--model", "tiny", "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "5",
                    "--max-concurrency", "1", "--save-result", str(saved), "--save-detailed", timeout=300)
    finally:
        srv.close()
    assert "Traceback" not in p.stderr, p.stderr
    res = json.loads(saved.read_text()) if saved.exists() else {}
    if odd == "shape":
        assert p.returncode == 0 and res["failed_requests"] == 1 and res["successful_requests"] == 2
        assert any("choices are not a list of objects" in e for e in res["errors"]), res["errors"]
    elif odd == "error":
        assert p.returncode == 4 and res["failed_requests"] == 3, p.stdout
        assert any("boom" in e for e in res["errors"]), res["errors"]
    else:
        want = len(tiny_tok.encode("".join(f" w{i}" for i in range(5)), add_special_tokens=False))
        assert p.returncode == 0 and res["total_output_tokens"] == 3 * want
        assert all(r["output_tokens"] == want and r["chunks"] == 7 for r in res["requests"])


def test_bad_rates_and_a_save_path_that_cannot_be_written_are_refused_before_the_run(tmp_path: Path) -> None:
    """A NaN burstiness hung the arrival draw, a NaN rate sent everything at once, a negative
    concurrency was asyncio's traceback, and an unwritable --save-result lost the run's figures
    after it; each is one line, exit 2, before a request is sent (no server is running here)."""
    base = ["bench-serve", "--base-url", "http://127.0.0.1:9", "--model", "tiny", "--num-prompts", "2"]
    for extra, says in ((["--request-rate", "1", "--burstiness", "nan"], "--burstiness positive and finite"),
                        (["--request-rate", "nan"], "--request-rate must be positive"),
                        (["--max-concurrency", "-1"], "--max-concurrency must be at least 1"),
                        (["--save-result", str(tmp_path / "no" / "r.json")], "--save-result"),
                        (["--trace", str(tmp_path / "missing")], "no such trace folder")):
        p = mstrace(*base, *extra, timeout=60)
        assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, (extra, p.stderr)


def test_the_saved_figures_are_strict_json() -> None:
    from viewer.bench_serve.results import strict_json

    got = strict_json({"request_rate": math.inf, "tpot_ms": {"mean": math.nan}, "xs": [1.0, -math.inf]})
    assert json.loads(json.dumps(got, allow_nan=False)) == {"request_rate": "inf", "tpot_ms": {"mean": None},
                                                            "xs": [1.0, "-inf"]}


def test_sharegpt_prompts_are_sampled_as_vllm_samples_them(tiny_tok: Any, tmp_path: Path) -> None:
    """Shuffled, then taken while they pass vLLM's filter (prompt and reply at least 4
    tokens, a prompt at most 1,024, both at most 2,048) until --num-prompts: the first n
    after the shuffle were taken as they came, so a file with enough usable conversations
    could be refused and a 3,000-token prompt sent."""
    from viewer.bench_serve.datasets import sharegpt_prompts

    def conv(prompt: str, reply: str) -> dict[str, Any]:
        return {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}

    good = [conv(f"question number {i} about the weather today", f"an answer of some length {i}") for i in range(4)]
    bad = [conv("hi", "a fine long enough reply"), conv("a fine long enough question", "ok"),
           conv("word " * 3000, "a fine long enough reply")]
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(bad * 3 + good))

    def n_tok(t: str) -> int:
        return len(tiny_tok.encode(t))

    for seed in range(5):
        got = sharegpt_prompts(f, 4, tiny_tok.encode, None, seed)
        assert sorted(p.text for p in got) == sorted(c["conversations"][0]["value"] for c in good)
        assert all(4 <= p.input_len <= 1024 and p.output_len >= 4 for p in got)
    fixed = sharegpt_prompts(f, 5, tiny_tok.encode, 2, 0)  # a fixed output length: the reply's own is not filtered
    assert {p.output_len for p in fixed} == {2} and all(n_tok(str(p.text)) >= 4 for p in fixed)


def test_a_workload_replays_its_items_own_fields_and_schedule(tiny_count: Callable[[str], int], tmp_path: Path) -> None:
    """--dataset-name workload sent each item's prompt and max_new_tokens only: its sampling,
    ignore_eos, add_special_tokens and arrival_s were dropped (every request greedy, at once)."""
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "late", "prompt": "hello there", "max_new_tokens": 3, "temperature": 0.7,
                              "top_p": 0.9, "seed": 5, "ignore_eos": True, "add_special_tokens": False,
                              "arrival_s": 2.0}) + "\n"
                  + json.dumps({"id": "early", "input_ids": [5, 6, 7], "max_new_tokens": 2}) + "\n")
    srv = CrlfServer(tiny_count)
    try:
        p = mstrace("bench-serve", "--base-url", f"http://127.0.0.1:{srv.port}", "--model", "tiny",
                    "--dataset-name", "workload", "--dataset-path", str(wl), "--num-prompts", "2", timeout=120)
    finally:
        srv.close()
    assert p.returncode == 0, p.stdout + p.stderr
    early, late = srv.bodies  # in the workload's order of arrival, not the file's
    assert early["prompt"] == [5, 6, 7] and early["temperature"] == 0.0 and "ignore_eos" not in early
    assert late["prompt"] == "hello there" and late["max_tokens"] == 3
    assert (late["temperature"], late["top_p"], late["seed"], late["ignore_eos"], late["add_special_tokens"]) == \
        (0.7, 0.9, 5, True, False)
