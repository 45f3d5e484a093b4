"""`mstrace serve` end to end: the official openai client, disconnects, bad input, shutdown."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.cli import mstrace
from tests.support.exact import F32_ARGS
from tests.support.serve_proc import Served, sse_events

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def test_completions_streamed_and_not_agree_and_count_their_tokens(client) -> None:
    whole = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # a chunk per token, even one whose text is not a whole character yet: the client's TTFT
    # and ITL are per token, as the server's are
    assert len([c for c in chunks if c.choices]) == 12


def test_the_openai_clients_requests_carry_the_http_servers_stamps(client, server: Served) -> None:
    """A chat request from the official client: its engine request's timeline starts with the
    HTTP server's stamps, in order, before the engine's `arrived` (its submit)."""
    import time

    from tracing.reader import Trace

    rid = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2).id
    want = ["http_read", "http_body", "http_route", "arrived"]
    for _ in range(600):  # the server commits its rows every second (60 s: a bound on a hang, not on speed)
        tl = Trace.open(server.out).table("timeline", ["request_id", "stage", "ts_ns", "step"]).to_pylist()
        got = sorted((r["ts_ns"], str(r["stage"]), r["step"]) for r in tl if r["request_id"] == rid)
        if {"http_read", "arrived"} <= {g[1] for g in got}:
            break
        time.sleep(0.1)
    assert [g[1] for g in got][:4] == want, got
    assert all(g[2] == -1 for g in got[:3])


def test_chat_streamed_and_not_agree(client) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stop_string_ends_the_output_before_it(client) -> None:
    free = client.completions.create(model="tiny", prompt="x = 1", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(free) > 6
    stop = free[3:6]  # a piece of what greedy decoding says anyway
    cut = client.completions.create(model="tiny", prompt="x = 1", max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == free[: free.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="x = 1", max_tokens=24, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == free[: free.find(stop)]


def test_seeded_sampling_repeats(client) -> None:
    def once() -> str:
        return client.completions.create(model="tiny", prompt="import os", max_tokens=16, temperature=1.0,
                                         seed=1234, extra_body={"ignore_eos": True}).choices[0].text

    assert once() == once()


def test_greedy_output_equals_mstrace_run_on_the_same_prompt(client, tmp_path: Path) -> None:
    prompt = "class Stack:\n    def push(self, x):"
    w = tmp_path / "w.jsonl"
    w.write_text(json.dumps({"id": "one", "prompt": prompt, "max_new_tokens": 20, "ignore_eos": True}) + "\n")
    p = mstrace("run", "--model", "tiny", "--workload", str(w), "--out", str(tmp_path / "t"), "-q", *F32_ARGS)
    assert p.returncode == 0, p.stderr
    want = pq.read_table(tmp_path / "t" / "requests").column("output_text").to_pylist()[0]
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    assert got == want


def test_models_and_health(client, server: Served) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    code, h = server.get("/health")
    assert code == 200 and h["status"] == "running"


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe{}", 400, "not valid JSON"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 10**6}, 400, "context"),
    ({"model": "tiny", "prompt": "word " * 5000, "max_tokens": 1}, 400, "context"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x" * (2 << 20)}, 413, "over"),
])
def test_bad_requests_get_an_openai_error_and_the_server_stays_up(server: Served, body, status, says) -> None:
    code, reply = server.post("/v1/completions", body)
    assert code == status, reply
    err = reply["error"]
    assert set(err) == {"message", "type", "param", "code"} and says in err["message"]
    assert server.get("/health")[0] == 200


def test_disconnected_clients_are_aborted_and_leak_nothing(tmp_path: Path) -> None:
    s = Served(tmp_path / "trace")
    body = {"model": "tiny", "prompt": "for i in range(10):", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    results: dict[int, object] = {}

    def client(i: int) -> None:
        leaves = i % 5 < 2  # 20 of 50 leave after a few chunks, long before their 1,900 tokens
        conn, resp = s.stream({**body, "max_tokens": 1900} if leaves else body)
        if leaves:
            for _ in range(3):
                resp.readline()
            resp.close()  # the response holds the socket open until it is closed too
            conn.close()
            results[i] = "left"
            return
        results[i] = sse_events(resp)
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    rc, _, err = s.stop()
    assert rc == 0, err
    done = [ev for ev in results.values() if ev != "left"]
    assert len(done) == 30 and all(ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 48 for ev in done)
    leaks = mstrace("leaks", str(s.out))
    assert leaks.returncode == 0 and "no leaks" in leaks.stdout, leaks.stdout + leaks.stderr
    req = pq.read_table(s.out / "requests", columns=["finish_reason", "finish_detail"]).to_pylist()
    aborted = [r for r in req if r["finish_reason"] == "aborted"]
    assert len(aborted) == 20 and {r["finish_detail"] for r in aborted} == {"client disconnected"}
    stages = set(pq.read_table(s.out / "timeline", columns=["stage"]).column("stage").to_pylist())
    assert "aborted" in stages
    meta = json.loads((s.out / "meta.json").read_text())
    assert meta["run"]["status"] == "complete" and meta["run"]["submitted"] == 50


def test_metrics_use_vllms_names_and_buckets_under_the_mstrace_prefix(client, server: Served) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler.serving.metrics import TTFT_BUCKETS

    def scrape() -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        c = server.conn()
        c.request("GET", "/metrics")
        body = c.getresponse().read().decode()
        c.close()
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out

    before = scrape()
    client.completions.create(model="tiny", prompt="print(", max_tokens=9, temperature=0,
                              extra_body={"ignore_eos": True})
    after = scrape()

    def one(m: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str) -> float:
        want = {"model_name": "tiny", "engine": "0", **labels}
        return sum(v for k, v in m.get(name, {}).items() if all(dict(k).get(a) == b for a, b in want.items()))

    assert one(after, "mstrace:request_success_total", finished_reason="length") == \
        one(before, "mstrace:request_success_total", finished_reason="length") + 1
    assert one(after, "mstrace:generation_tokens_total") >= one(before, "mstrace:generation_tokens_total") + 9
    assert one(after, "mstrace:request_generation_tokens_sum") == one(before, "mstrace:request_generation_tokens_sum") + 9
    assert one(after, "mstrace:inter_token_latency_seconds_count") == \
        one(before, "mstrace:inter_token_latency_seconds_count") + 8
    edges = sorted(float(dict(k)["le"]) for k in after["mstrace:time_to_first_token_seconds_bucket"])
    assert edges == [*TTFT_BUCKETS, float("inf")]
    assert one(after, "mstrace:cycle_seconds_count") > one(before, "mstrace:cycle_seconds_count")
    for gauge in ("mstrace:num_requests_running", "mstrace:num_requests_waiting", "mstrace:kv_cache_usage_perc"):
        assert gauge in after
    assert one(after, "mstrace:kv_cache_usage_perc") == 0.0  # nothing running: every block back
    # the names vLLM's dashboard still queries: the same samples as the v1 names
    for old, new in (("time_per_output_token_seconds_count", "inter_token_latency_seconds_count"),
                     ("time_per_output_token_seconds_sum", "inter_token_latency_seconds_sum"),
                     ("gpu_cache_usage_perc", "kv_cache_usage_perc"),
                     ("gpu_prefix_cache_queries_total", "prefix_cache_queries_total"),
                     ("gpu_prefix_cache_hits_total", "prefix_cache_hits_total"),
                     ("request_max_num_generation_tokens_sum", "request_generation_tokens_sum"),
                     ("request_max_num_generation_tokens_count", "request_generation_tokens_count")):
        assert "mstrace:" + old in after and after["mstrace:" + old] == after["mstrace:" + new], old
    # the live cost table follows the trace's commits (every 0.5 s), a few rounds behind
    import time

    deadline = time.monotonic() + 60  # a bound on a hang, not on speed
    while one(live := scrape(), "mstrace:boundary_seconds_total", boundary="device_compute", view="device") <= 0:
        assert time.monotonic() < deadline, "no live cost counters"
        time.sleep(0.25)
    cycles = one(live, "mstrace:cost_cycle_seconds_total")
    device = sum(v for k, v in live["mstrace:boundary_seconds_total"].items() if dict(k)["view"] == "device")
    assert cycles > 0 and device == pytest.approx(cycles, rel=1e-6)  # a view partitions the cycles


def test_bench_serve_measures_at_the_client_and_matches_the_servers_trace(server: Served, tmp_path: Path) -> None:
    saved = tmp_path / "result.json"
    p = mstrace("bench-serve", "--base-url", f"http://127.0.0.1:{server.port}", "--num-prompts", "12",
                "--random-input-len", "32", "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "4",
                "--request-rate", "50", "--trace", str(server.out), "--save-result", str(saved), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Successful requests:                    12" in p.stdout and "Mean TTFT (ms):" in p.stdout
    res = json.loads(saved.read_text())
    assert res["failed_requests"] == 0 and res["total_output_tokens"] == 12 * 8
    side = res["server_side"]
    assert side["matched"] == side["of"] == 12
    # the client's clock starts before the server's and stops after it: the hop cannot be negative
    assert side["hop_ttft_min_ms"] >= 0 and side["hop_e2el_ms"]["median"] >= 0
    # and each leg alone neither: the client's send comes before the route's submit and the
    # token's collection before the client reads it (one machine: the two clocks are one)
    assert side["hop_in_min_ms"] >= 0 and side["hop_out_min_ms"] >= 0
    assert side["hop_in_ms"]["mean"] + side["hop_out_ms"]["mean"] == pytest.approx(side["hop_ttft_ms"]["mean"])
    # the hop in, cut where the client wrote the request and at the HTTP server's own stamps
    # (the trace's http_* timeline events): every request has them, each leg is forward in
    # time, and they add up to the leg
    assert side["hop_in_legs_of"] == 12
    legs = ("hop_in_client_ms", "hop_in_socket_ms", "hop_in_parse_ms", "hop_in_route_ms", "hop_in_submit_ms")
    assert side["hop_in_legs_min_ms"] >= 0 and side["hop_in_client_ms"]["median"] > 0
    assert sum(side[k]["mean"] for k in legs) == pytest.approx(side["hop_in_ms"]["mean"])
    assert "send -> written" in p.stdout and "route -> submit" in p.stdout
    # the hop out, cut where the sender posted the first token and its chunk was handed over
    assert side["hop_out_legs_of"] == 12 and side["hop_out_legs_min_ms"] >= 0
    out_legs = ("hop_out_sender_ms", "hop_out_loop_ms", "hop_out_read_ms")
    assert sum(side[k]["mean"] for k in out_legs) == pytest.approx(side["hop_out_ms"]["mean"])
    assert "posted -> handed" in p.stdout
    # stamped outside any round: the round running meanwhile is not the request's
    from tracing.reader import Trace

    tl = Trace.open(server.out).table("timeline", ["stage", "step"]).to_pylist()
    http = [r["step"] for r in tl if str(r["stage"]).startswith("http_")]
    assert len(http) >= 5 * 12 and set(http) == {-1}


def test_a_chat_streams_hop_out_is_cut_at_its_role_chunk(server: Served, tmp_path: Path) -> None:
    # the client counts the role chunk as the first (it has a choice): the second stamp is
    # taken as that chunk is handed over, so no leg can come out negative
    saved = tmp_path / "result.json"
    p = mstrace("bench-serve", "--base-url", f"http://127.0.0.1:{server.port}", "--endpoint", "chat",
                "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "1", "--max-concurrency", "3",
                "--trace", str(server.out), "--save-result", str(saved), timeout=300)
    assert p.returncode == 0, p.stderr
    side = json.loads(saved.read_text())["server_side"]
    assert side["matched"] == side["hop_out_legs_of"] == 6 and side["hop_out_legs_min_ms"] >= 0


def test_bench_serve_random_prompts_are_as_long_as_the_server_counts_them(server: Served, tmp_path: Path) -> None:
    saved = tmp_path / "result.json"
    p = mstrace("bench-serve", "--base-url", f"http://127.0.0.1:{server.port}", "--num-prompts", "16",
                "--random-input-len", "64", "--random-range-ratio", "0.25", "--random-output-len", "2",
                "--max-concurrency", "4", "--save-result", str(saved), "--save-detailed", timeout=300)
    assert p.returncode == 0, p.stderr
    rows = json.loads(saved.read_text())["requests"]
    assert len(rows) == 16 and all(r["ok"] for r in rows)
    # the server's usage against the dataset's count (whatever the tokenizer adds, a BOS, on both sides)
    assert [r["prompt_tokens"] for r in rows] == [r["input_len"] for r in rows]
    assert all(48 <= r["input_len"] <= 80 for r in rows)


def test_bench_serve_counts_a_refused_request_as_failed(server: Served) -> None:
    p = mstrace("bench-serve", "--base-url", f"http://127.0.0.1:{server.port}", "--num-prompts", "2",
                "--random-input-len", "8", "--random-output-len", "100000", timeout=120)
    assert p.returncode == 4 and "Failed requests:                        2" in p.stdout
    assert "exceeds the model's context" in p.stdout


def test_a_slow_client_blocks_only_its_own_writes(tmp_path: Path) -> None:
    """A client that stops reading fills its socket; the server's write to it then waits (a long
    response_deliver row on stream http) while the rounds and every other client go on."""
    import socket
    import time

    s = Served(tmp_path / "trace", "--send-buffer-bytes", "16384")
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    slow.connect(("127.0.0.1", s.port))
    req = json.dumps({"model": "tiny", "prompt": "while True:", "max_tokens": 1500, "temperature": 0,
                      "ignore_eos": True, "stream": True}).encode()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(req), req))
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    finished: list[int] = []
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:  # normal clients, one after another, while the slow one barely reads
        conn, resp = s.stream(body)
        ev = sse_events(resp)
        conn.close()
        finished.append(ev[-2]["usage"]["completion_tokens"])
        slow.recv(1)
    slow.close()
    rc, _, err = s.stop()
    assert rc == 0, err
    assert finished and set(finished) == {64}
    probes = pq.read_table(s.out / "probes", columns=["ts_ns", "dur_ns", "boundary", "stream"]).to_pylist()
    writes = [p for p in probes if p["boundary"] == "response_deliver" and p["stream"] == "http"]
    blocked = max(writes, key=lambda p: p["dur_ns"])
    assert blocked["dur_ns"] > 1e9, "the slow client's socket never filled"
    steps = pq.read_table(s.out / "steps", columns=["ts_ns"]).column("ts_ns").to_pylist()
    during = [t for t in steps if blocked["ts_ns"] < t < blocked["ts_ns"] + blocked["dur_ns"]]
    assert len(during) > 50, len(during)  # rounds went on while that write waited


def test_an_api_key_guards_every_v1_route_but_not_health(tmp_path: Path) -> None:
    s = Served(tmp_path / "trace", "--api-key", "s3cret")
    try:
        code, reply = s.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert code == 401 and reply["error"]["type"] == "authentication_error"
        code, reply = s.post("/v1/completions", b"{broken", {"Authorization": "Bearer s3cret"})
        assert code == 400  # the key is checked first, then the body
        code, reply = s.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2},
                             {"Authorization": "Bearer s3cret"})
        assert code == 200 and reply["usage"]["completion_tokens"] >= 1
        assert s.get("/health")[0] == 200
        guarded = openai.OpenAI(base_url=s.base, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            guarded.models.list()
    finally:
        rc, _, err = s.stop()
    assert rc == 0, err


def test_serve_refuses_bad_options_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    for flags, says in ((["--port", "70000"], "--port"), (["--mode", "all"], "serve one mode"),
                        (["--max-body-bytes", "10"], "--max-body-bytes"),
                        (["--model", str(bad)], "unsupported architecture"),
                        (["--model", str(tmp_path / "nowhere")], "not found")):
        p = mstrace("serve", "--model", "tiny", "--out", str(tmp_path / "t"), *flags, timeout=120)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "t").exists()


# Every field the API (or vLLM) defines and this server does not implement is a 400
# naming it, never a 200 that ignores it; their neutral values are accepted.
REFUSED_COMPLETION = [("best_of", 2), ("response_format", {"type": "json_object"}),
                      ("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("guided_choice", ["a"]),
                      ("guided_grammar", "root ::= 'a'"), ("structured_outputs", {"regex": "a"}),
                      ("suffix", "end"), ("top_k", 1), ("min_p", 0.5)]
REFUSED_CHAT = [("echo", True), ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto")]
NEUTRAL = {"n": 1, "best_of": 1, "frequency_penalty": 0.0, "presence_penalty": 0, "repetition_penalty": 1.0,
           "logit_bias": {}, "stop_token_ids": [], "min_tokens": 0, "response_format": {"type": "text"},
           "top_k": -1, "min_p": 0}


def test_known_unsupported_fields_are_refused_by_name_and_neutral_values_accepted(server: Served) -> None:
    base = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    for name, value in REFUSED_COMPLETION:
        status, body = server.post("/v1/completions", {**base, name: value})
        assert status == 400, (name, body)
        assert body["error"]["param"] == name and "not supported" in body["error"]["message"], body
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for name, value in REFUSED_CHAT:
        status, body = server.post("/v1/chat/completions", {**chat, name: value})
        assert status == 400 and body["error"]["param"] == name, (name, body)
    image = [{"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    status, body = server.post("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": image}]})
    assert status == 400 and body["error"]["param"] == "messages.content" and "image_url" in body["error"]["message"]
    status, body = server.post("/v1/completions", {**base, "stream_options": {"include_usage": True}})
    assert status == 400 and body["error"]["param"] == "stream_options", body
    status, body = server.post("/v1/completions", {**base, "stream": True,
                                                   "stream_options": {"continuous_usage_stats": True}})
    assert status == 400 and "continuous_usage_stats" in body["error"]["param"], body
    status, body = server.post("/v1/completions", {**base, **NEUTRAL, "some_future_field": 1})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body


def test_a_batch_of_prompts_gets_a_choice_each_in_order_as_the_same_prompts_alone(server: Served) -> None:
    prompts = ["def main(", "import os", "class A:"]
    alone = [server.post("/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0,
                                             "ignore_eos": True})[1] for p in prompts]
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 6,
                                                   "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert body["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert body["usage"]["completion_tokens"] == 18
    ids = [[1, 40, 41, 42], [1, 50, 51]]
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and len(body["choices"]) == 2 and body["usage"]["prompt_tokens"] == 7, body
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": ["ok", "x" * 100_000],
                                                   "max_tokens": 2})
    assert status in (400, 413), body


def test_prompt_tokens_are_what_autotokenizer_gives_and_chat_has_one_bos(server: Served) -> None:
    from transformers import AutoTokenizer

    from scheduler.model.presets import resolve_model

    hf = AutoTokenizer.from_pretrained(str(resolve_model("tiny")), local_files_only=True)
    prompt = "def parse_args(argv):\n    héllo 🎉"
    _, body = server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert body["usage"]["prompt_tokens"] == len(hf(prompt)["input_ids"]) == len(hf(prompt, add_special_tokens=False)["input_ids"]) + 1
    _, body = server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                              "add_special_tokens": False})
    assert body["usage"]["prompt_tokens"] == len(hf(prompt, add_special_tokens=False)["input_ids"])
    # the plain chat template (no template in the folder) writes the BOS once, at its start
    _, body = server.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 1,
                                                   "messages": [{"role": "user", "content": prompt}]})
    rendered = f"<s>user: {prompt}\nassistant:"
    assert body["usage"]["prompt_tokens"] == len(hf(rendered, add_special_tokens=False)["input_ids"])


def test_the_openai_client_gets_a_batch_and_a_named_refusal(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt=["def f(", "import re"], max_tokens=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and out.usage is not None and out.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.body["param"] == "tools" and "not supported" in e.value.body["message"]  # type: ignore[index]


def test_n_samples_share_the_prompt_blocks_and_each_repeats_alone(server: Served) -> None:
    """n = 4 seeded samples: four choices, each what the same request alone with seed + j
    gives; samples after the first reuse the prompt's full KV blocks (prefix sharing)."""
    import time

    from tracing.reader import read_table

    prompt = "def main(argv):\n    parser = argparse.ArgumentParser(description='a tool')\n    args = parser"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    status, out = server.post("/v1/completions", {**body, "n": 4})
    assert status == 200, out
    texts = [c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3] and len(set(texts)) > 1
    alone = [server.post("/v1/completions", {**body, "seed": 7 + j})[1] for j in range(4)]
    assert texts == [a["choices"][0]["text"] for a in alone]
    assert out["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"] > 32
    assert out["usage"]["completion_tokens"] == 32
    rid = out["id"]
    deadline = time.monotonic() + 60  # a bound on a hang, not on speed
    while time.monotonic() < deadline:  # the trace commits at least every second
        rows = {r["request_id"]: r["cached_prefix_len"]
                for r in read_table(server.out, "requests", columns=["request_id", "cached_prefix_len"]).to_pylist()}
        if all(f"{rid}-{j}" in rows for j in range(4)):
            break
        time.sleep(0.5)
    assert all(rows[f"{rid}-{j}"] >= 32 for j in range(1, 4)), rows


def test_a_streamed_batch_with_n_names_each_choice(server: Served) -> None:
    prompts = ["def main(", "import os"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2}
    whole = server.post("/v1/completions", body)[1]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    c = server.conn()
    c.request("POST", "/v1/completions", json.dumps({**body, "stream": True,
                                                     "stream_options": {"include_usage": True}}),
              {"Content-Type": "application/json"})
    events = [e for e in sse_events(c.getresponse()) if isinstance(e, dict)]
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for e in events:
        for ch in e["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finish == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert events[-1]["usage"] == whole["usage"]
    status, err = server.post("/v1/completions", {**body, "n": 17})
    assert status == 400 and err["error"]["param"] == "n", err


def test_logit_bias_stop_token_ids_and_penalties_are_applied_or_refused_by_name(server: Served) -> None:
    base = {"model": "tiny", "prompt": "def main(", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, pushed = server.post("/v1/completions", {**base, "logit_bias": {"300": 100}, "logprobs": 0})
    assert status == 200 and set(pushed["choices"][0]["logprobs"]["tokens"]) == {pushed["choices"][0]["logprobs"]["tokens"][0]}
    from transformers import AutoTokenizer

    from scheduler.model.presets import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("tiny")), local_files_only=True)
    assert pushed["choices"][0]["logprobs"]["tokens"][0] == tok.decode([300])
    # token 300 is drawn first (its bias), and it is a stop token: generated, counted, not text
    status, stopped = server.post("/v1/completions", {**base, "logit_bias": {"300": 100}, "stop_token_ids": [300]})
    assert status == 200 and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == "" and stopped["usage"]["completion_tokens"] == 1
    status, pen = server.post("/v1/completions", {**base, "frequency_penalty": 2.0, "presence_penalty": 2.0,
                                                  "repetition_penalty": 1.5})
    assert status == 200 and pen["usage"]["completion_tokens"] == 6
    for bad, param in (({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                       ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"min_tokens": 7}, "min_tokens")):
        status, body = server.post("/v1/completions", {**base, **bad})
        assert status == 400 and body["error"]["param"] == param, (bad, body)
    status, body = server.post("/v1/completions", {**base, "stop_token_ids": [10 ** 9]})
    assert status == 400 and "outside the vocabulary" in body["error"]["message"], body


def test_requests_in_flight_when_the_engine_stalls_end_instead_of_hanging(tmp_path: Path) -> None:
    """The injected deadlock stalls the engine with one request streaming and one waiting for
    its first token: the stream ends (`abort`), the other gets a 503 naming the stall, and a
    request sent afterwards too, each well before its client's own timeout."""
    s = Served(tmp_path / "trace", "--inject", "deadlock", "--mode", "overlap", "--wait-timeout", "2")
    try:
        # as long as tiny's context allows: the deadlock needs this decode still running when the
        # second prefill joins (200 tokens took 0.3-0.6 s here; a faster host or a slow client
        # could finish them first); the stall aborts it anyway
        c, resp = s.stream({"model": "tiny", "prompt": "def f(", "max_tokens": 1900, "ignore_eos": True})
        first = resp.readline()  # the decode is running; a prefill joining it now deadlocks the round
        assert first.startswith(b"data: "), first
        box: dict[str, object] = {}
        waiter = threading.Thread(target=lambda: box.update(r=s.post("/v1/completions", {
            "model": "tiny", "prompt": "import os", "max_tokens": 4})))
        waiter.start()
        events = sse_events(resp)  # returns once the server ends the stream
        waiter.join(60)
        assert not waiter.is_alive(), "the waiting request hung after the stall"
        finishes = [ch["finish_reason"] for e in events if isinstance(e, dict) for ch in e["choices"]]
        assert finishes[-1] == "abort" and events[-1] == "[DONE]", events[-3:]
        status, body = box["r"]  # type: ignore[misc]
        assert status == 503 and "stalled" in body["error"]["message"], body
        status, body = s.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert status == 503, body
    finally:
        s.stop()
