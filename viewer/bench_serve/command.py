"""`mstrace bench-serve`: load any OpenAI-compatible server the way `vllm bench serve`
does, measure at the client, and (for an mstrace server) compare with its trace."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import typer

Fail = Callable[..., NoReturn]


def click_command(fail: Fail) -> Any:
    """`bench-serve` as a click command, built when it is asked for (viewer/cli.py)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(name="bench-serve")(_command(fail))
    return typer.main.get_command(app)


def _command(fail: Fail) -> Callable[..., None]:
    def bench_serve(
        base_url: Annotated[str, typer.Option(help="The server, e.g. http://127.0.0.1:8000.")] = "http://127.0.0.1:8000",
        endpoint: Annotated[Literal["completions", "chat"], typer.Option(help="/v1/completions or /v1/chat/completions.")] = "completions",
        model: Annotated[str | None, typer.Option(help="Model name to ask for (default: the server's first, from /v1/models).")] = None,
        tokenizer: Annotated[str | None, typer.Option(help="Local model folder or mstrace preset whose tokenizer makes and counts the prompts (default: --model).")] = None,
        dataset_name: Annotated[Literal["random", "sharegpt", "workload"], typer.Option(help="random, a ShareGPT JSON file, or an mstrace workload JSONL file.")] = "random",
        dataset_path: Annotated[Path | None, typer.Option(help="The file, for sharegpt and workload.")] = None,
        num_prompts: Annotated[int, typer.Option(help="Requests to send.")] = 1000,
        request_rate: Annotated[float, typer.Option(help="Requests per second; inf sends them all at once.")] = math.inf,
        burstiness: Annotated[float, typer.Option(help="Gamma shape of the arrival gaps (1 = Poisson).")] = 1.0,
        max_concurrency: Annotated[int | None, typer.Option(help="At most this many requests in flight.")] = None,
        random_input_len: Annotated[int, typer.Option(help="random: prompt tokens, as --tokenizer counts them (what it adds, such as a BOS, included).")] = 1024,
        random_output_len: Annotated[int, typer.Option(help="random: max_tokens.")] = 128,
        random_range_ratio: Annotated[float, typer.Option(help="random: lengths vary by +- this fraction.")] = 0.0,
        random_prefix_len: Annotated[int, typer.Option(help="random: tokens of a prefix every prompt shares.")] = 0,
        sharegpt_output_len: Annotated[int | None, typer.Option(help="sharegpt: max_tokens for every request (default: the reply's length).")] = None,
        ignore_eos: Annotated[bool, typer.Option(help="Ask for max_tokens whatever the model says (vLLM's extension).")] = False,
        seed: Annotated[int, typer.Option(help="Seed for the prompts and the arrivals.")] = 0,
        api_key: Annotated[str | None, typer.Option(help="Bearer key, if the server wants one.")] = None,
        request_timeout: Annotated[float, typer.Option(help="Seconds one request may take in all, queueing at the server included, before it counts as failed (inf: no limit).")] = 1800.0,
        save_result: Annotated[Path | None, typer.Option(help="Also write the figures as JSON.")] = None,
        save_detailed: Annotated[bool, typer.Option(help="With --save-result: every request too (lengths, times, text).")] = False,
        trace: Annotated[Path | None, typer.Option(help="The server's mstrace trace: print its side of the same requests.")] = None,
    ) -> None:
        """Benchmark a serving endpoint like `vllm bench serve`: TTFT, TPOT, ITL, E2E at the client."""
        args = dict(locals())
        args.pop("fail", None)  # (locals() holds the closure's names too)
        _run(args, fail)

    return bench_serve


def _run(a: dict[str, Any], fail: Fail) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from viewer.extras import message, missing

    gap = missing("bench")  # first: without its client nothing else is worth loading
    if gap is not None:
        fail(message("mstrace bench-serve", *gap))
    from viewer.bench_serve import results, runner
    from viewer.bench_serve.datasets import (
        DatasetError,
        random_prompts,
        sharegpt_prompts,
        workload_prompts,
    )
    from viewer.bench_serve.http_client import Endpoint

    if a["num_prompts"] < 1:
        fail("--num-prompts must be at least 1")
    if a["save_detailed"] and a["save_result"] is None:
        fail("--save-detailed needs --save-result FILE")
    if a["dataset_name"] != "random" and a["dataset_path"] is None:
        fail(f"--dataset-name {a['dataset_name']} needs --dataset-path FILE")
    if a["max_concurrency"] is not None and a["max_concurrency"] < 0:
        fail("--max-concurrency must be at least 1 (0: no limit)")
    # checked before the run, whose figures a bad path lost after it
    out = a["save_result"]
    if out is not None and (out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK)):
        fail(f"--save-result {out}: not a file in a folder this user can write")
    if a["trace"] is not None and not a["trace"].is_dir():
        fail(f"--trace {a['trace']}: no such trace folder")
    chat = a["endpoint"] == "chat"
    try:
        ep = Endpoint(a["base_url"], "/v1/chat/completions" if chat else "/v1/completions", a["api_key"],
                      a["request_timeout"])
        offsets = runner.arrival_offsets(a["num_prompts"], a["request_rate"], a["burstiness"], a["seed"])
    except ValueError as e:
        fail(str(e))
    model = a["model"] or _first_model(a["base_url"], a["api_key"], fail)
    tok = _tokenizer(a["tokenizer"] or model, fail)
    try:
        if a["dataset_name"] == "random":
            prompts = random_prompts(a["num_prompts"], a["random_input_len"], a["random_output_len"],
                                     a["random_range_ratio"], a["random_prefix_len"], tok.vocab_size,
                                     tok.encode, tok.decode, a["seed"])
        elif a["dataset_name"] == "sharegpt":
            prompts = sharegpt_prompts(a["dataset_path"], a["num_prompts"], tok.encode, a["sharegpt_output_len"],
                                       a["seed"])
        else:
            prompts = workload_prompts(a["dataset_path"], a["num_prompts"], tok.encode)
            if math.isinf(a["request_rate"]) and any(p.arrival_s for p in prompts):
                offsets = [p.arrival_s for p in prompts]  # the workload's own schedule, unless a rate is given
    except DatasetError as e:
        fail(str(e))
    if chat and any(not isinstance(p.text, str) for p in prompts):
        fail("--endpoint chat needs text prompts; these are token ids")
    err = Console(stderr=True)
    with Progress(TextColumn("[bold]bench-serve"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, disable=not err.is_terminal) as progress:
        task = progress.add_task("", total=len(prompts))
        replies, duration = runner.run(ep, prompts, offsets, model, chat, a["ignore_eos"], a["max_concurrency"],
                                       lambda _: progress.advance(task))
    def count(text: str) -> int:  # a reply's tokens where the server sent no usage (vLLM's count)
        return len(tok.encode(text, add_special_tokens=False))

    res = results.summarize(prompts, replies, duration, count)
    print(results.render(res))
    if a["trace"] is not None:
        res["server_side"] = results.server_side(a["trace"], replies)
        print(results.render_server_side(res["server_side"]))
    res["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in a.items() if k != "api_key"}
    if a["save_detailed"]:
        res["requests"] = results.details(prompts, replies, count)
    if out is not None:
        try:
            out.write_text(json.dumps(results.strict_json(res), indent=2, default=str, allow_nan=False))
        except OSError as e:
            fail(f"--save-result {out}: {e.strerror or e}")
    if res["successful_requests"] == 0:
        fail("no request succeeded", 4)


def _first_model(base_url: str, api_key: str | None, fail: Fail) -> str:
    from urllib.error import URLError
    from urllib.request import ProxyHandler, Request, build_opener

    req = Request(base_url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        # no proxy, as the benchmark's own session (trust_env=False): the server is asked directly
        with build_opener(ProxyHandler({})).open(req, timeout=30) as r:
            data = json.loads(r.read())
        return str(data["data"][0]["id"])
    except (URLError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
        fail(f"could not ask {base_url}/v1/models for a model name (give --model): {e}")


class _Tok:
    def __init__(self, folder: Path) -> None:
        from scheduler.hops.tokenizer import Tokenizer

        self._t = Tokenizer(folder)
        cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
        self.vocab_size = int(cfg.get("vocab_size") or self._t.vocab_size())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._t.encode(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self._t.decode(ids)


def _tokenizer(name: str, fail: Fail) -> _Tok:
    from scheduler.hops.tokenizer import TokenizerError

    folder = Path(name)
    if not folder.is_dir():
        try:  # an mstrace preset: built offline on first use, like `run` and `serve` do
            from scheduler.model.presets import resolve_model

            folder = resolve_model(name)
        except (FileNotFoundError, ValueError) as e:
            fail(f"--tokenizer {name}: not a local model folder or preset ({e})")
    try:
        return _Tok(folder)
    except (TokenizerError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        fail(f"--tokenizer {folder}: no usable tokenizer")
