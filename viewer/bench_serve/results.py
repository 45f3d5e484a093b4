"""A benchmark's figures, measured at the client, in `vllm bench serve`'s result block;
and, given the server's mstrace trace, the same requests as the server saw them.

Definitions (vLLM's): TTFT = request sent -> first chunk with a choice (its text may
be empty); TPOT = (E2E - TTFT) / (output tokens - 1); ITL = gaps between those
chunks; E2E = sent -> the last chunk with a choice (the trailing usage chunk and [DONE] carry
no token). Output tokens come from the final usage chunk when the server sends one, else from
the text, tokenized without special tokens (vLLM's count; counting chunks counted a chat role
chunk and an empty finish chunk as tokens, and a chunk of several tokens as one).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from viewer.analysis.serving import Dist
from viewer.bench_serve.datasets import Prompt
from viewer.bench_serve.http_client import Reply

MS = 1e-6


def _dist(xs: list[float]) -> dict[str, float]:
    """vLLM's mean / median / p99 (the report's exact linear-interpolated percentiles)."""
    d = Dist.of(np.asarray(xs, dtype=np.float64))
    return {"mean": d.mean, "median": d.p50, "p99": d.p99}


Count = Callable[[str], int]  # a text's tokens, without special tokens


def _usage(r: Reply, key: str) -> int | None:
    v = r.usage.get(key) if r.usage else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _output_tokens(r: Reply, count: Count) -> int:
    n = _usage(r, "completion_tokens")
    return n if n is not None else count(r.text)


def summarize(prompts: list[Prompt], replies: list[Reply], duration_s: float, count: Count) -> dict[str, Any]:
    ok = [(p, r) for p, r in zip(prompts, replies, strict=True) if r.ok]
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    out_tokens = in_tokens = 0
    for p, r in ok:
        n = _output_tokens(r, count)
        out_tokens += n
        n_in = _usage(r, "prompt_tokens")
        in_tokens += p.input_len if n_in is None else n_in
        lat = (r.end_ns - r.sent_ns) * MS
        e2e.append(lat)
        if r.chunk_ns:
            first = (r.chunk_ns[0] - r.sent_ns) * MS
            ttft.append(first)
            if n > 1:
                tpot.append((lat - first) / (n - 1))
            itl.extend(float(b - a) * MS for a, b in zip(r.chunk_ns, r.chunk_ns[1:], strict=False))
    errors: dict[str, int] = {}
    for r in replies:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "successful_requests": len(ok), "failed_requests": len(replies) - len(ok), "errors": errors,
        "duration_s": duration_s, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
        "ttft_ms": _dist(ttft), "tpot_ms": _dist(tpot), "itl_ms": _dist(itl), "e2el_ms": _dist(e2e),
    }


def details(prompts: list[Prompt], replies: list[Reply], count: Count) -> list[dict[str, Any]]:
    """Every request as the client saw it (--save-detailed), in the order sent: its lengths
    as the dataset counted them and as the server's usage did, and its times in ms from
    its send."""
    rows = []
    for p, r in zip(prompts, replies, strict=True):
        rows.append({
            "ok": r.ok, "error": r.error, "request_id": r.request_id,
            "input_len": p.input_len, "prompt_tokens": _usage(r, "prompt_tokens"),
            "output_len": p.output_len, "output_tokens": _output_tokens(r, count), "chunks": len(r.chunk_ns),
            "ttft_ms": (r.chunk_ns[0] - r.sent_ns) * MS if r.chunk_ns else None,
            "itl_ms": [float(b - a) * MS for a, b in zip(r.chunk_ns, r.chunk_ns[1:], strict=False)],
            "e2el_ms": (r.end_ns - r.sent_ns) * MS if r.end_ns else None,
            "text": r.text,
        })
    return rows


def render(res: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, v: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40}{format(v, fmt):<10}")

    row("Successful requests:", res["successful_requests"])
    row("Failed requests:", res["failed_requests"])
    row("Benchmark duration (s):", res["duration_s"], ".2f")
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", res["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", res["total_token_throughput"], ".2f")
    for key, head, short in (("ttft_ms", "Time to First Token", "TTFT"),
                             ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append(f"{head:-^{w}}")
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            row(f"{name} {short} (ms):", res[key][stat], ".2f")
    lines.append("=" * w)
    for err, n in res.get("errors", {}).items():
        lines.append(f"failed x{n}: {err}")
    return "\n".join(lines)


def server_side(trace: Path, replies: list[Reply], wait_s: float = 5.0) -> dict[str, Any]:
    """The server's TTFT and E2E for the same requests (joined on the response id), and
    the client's minus the server's: the network and HTTP hop, which must be >= 0.

    The server's clock starts when its route submits the request, the client's when it
    sends; both end at the first token (server: collected; client: its chunk read).

    The TTFT hop is cut in its two legs, in (the client's send to the route's submit:
    connect, accept, parse, validation) and out (the token's collection to the client's
    read of its chunk: the sender thread, the event loop, the write, the client's own
    loop). That reads the server's times against the client's, so it holds only where
    both run on one machine, as `--trace` needs anyway (both clocks are CLOCK_MONOTONIC:
    perf_counter_ns there, monotonic_ns here)."""
    import time

    from tracing.reader import Trace, TraceError

    want = {r.request_id: r for r in replies if r.ok and r.request_id and r.chunk_ns}
    cols = ["request_id", "arrival_ns", "first_token_ns", "finish_ns"]
    deadline = time.monotonic() + wait_s
    rows: dict[str, dict[str, int]] = {}
    while True:  # the server commits finished requests every flush: wait for the last ones
        try:
            t = Trace.open(trace).table("requests", cols).to_pylist()
        except TraceError:
            t = []
        rows = {r["request_id"]: r for r in t if r["request_id"] in want}
        if len(rows) == len(want) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    from scheduler.serving.http_timing import OUT_STAGES, STAGES

    while True:  # a short stream's requests row can be committed a flush before its first token's stamps
        stamps = _http_stamps(trace, set(rows), STAGES + OUT_STAGES)
        stamped = [_whole(stamps.get(rid, {}), OUT_STAGES) is not None for rid in rows]
        if all(stamped) or not any(stamped) or time.monotonic() > deadline:  # (none: a server that writes none)
            break
        time.sleep(0.25)
    s_ttft, s_e2e, hop_ttft, hop_e2e, hop_in, hop_out = [], [], [], [], [], []
    legs: dict[str, list[float]] = {k: [] for k in (*IN_LEGS, *OUT_LEGS)}
    for rid, row in rows.items():
        c = want[rid]
        st = (row["first_token_ns"] - row["arrival_ns"]) * MS
        se = (row["finish_ns"] - row["arrival_ns"]) * MS
        s_ttft.append(st)
        s_e2e.append(se)
        hop_ttft.append((c.chunk_ns[0] - c.sent_ns) * MS - st)
        hop_e2e.append((c.done_ns - c.sent_ns) * MS - se)
        hop_in.append((row["arrival_ns"] - c.sent_ns) * MS)
        hop_out.append((c.chunk_ns[0] - row["first_token_ns"]) * MS)
        h = _whole(stamps.get(rid, {}), STAGES)
        if h is not None:
            marks = [c.sent_ns, c.written_ns or c.sent_ns, *h, row["arrival_ns"]]
            for k, a, b in zip(IN_LEGS, marks[:-1], marks[1:], strict=True):
                legs[k].append((b - a) * MS)
        f = _whole(stamps.get(rid, {}), OUT_STAGES)
        if f is not None:
            marks = [row["first_token_ns"], *f, c.chunk_ns[0]]
            for k, a, b in zip(OUT_LEGS, marks[:-1], marks[1:], strict=True):
                legs[k].append((b - a) * MS)
    return {"matched": len(rows), "of": len(want), "server_ttft_ms": _dist(s_ttft), "server_e2el_ms": _dist(s_e2e),
            "hop_ttft_ms": _dist(hop_ttft), "hop_e2el_ms": _dist(hop_e2e),
            "hop_ttft_min_ms": min(hop_ttft) if hop_ttft else float("nan"),
            "hop_in_ms": _dist(hop_in), "hop_out_ms": _dist(hop_out),
            "hop_in_min_ms": min(hop_in) if hop_in else float("nan"),
            "hop_out_min_ms": min(hop_out) if hop_out else float("nan"),
            "hop_in_legs_of": len(legs[IN_LEGS[0]]), "hop_out_legs_of": len(legs[OUT_LEGS[0]]),
            **{k: _dist(v) for k, v in legs.items()},
            "hop_in_legs_min_ms": min((x for k in IN_LEGS for x in legs[k]), default=float("nan")),
            "hop_out_legs_min_ms": min((x for k in OUT_LEGS for x in legs[k]), default=float("nan"))}


# The hop in, cut where the client wrote the request and the server stamped it
# (scheduler/serving/http_timing.py): the send -> its body's write begins (the client's own
# loop: the pool, a new connection's connect, the request's build) -> the parser meets its
# first bytes (accept, the kernel, the server loop's turn to read) -> its body complete
# (the parse) -> the route begins (the ASGI task's turn, the middleware, the validation) ->
# the submit (the route: its checks, the engine's submit). Per request they add up to hop_in_ms.
IN_LEGS = ("hop_in_client_ms", "hop_in_socket_ms", "hop_in_parse_ms", "hop_in_route_ms", "hop_in_submit_ms")
# The hop out, cut where the server stamped a stream's first token: its collection -> the
# sender posted its text to the event loop (the sender's turn, the detokenizer) -> its chunk
# handed to the server to write (the event loop's turn, the chunk's build) -> the client read
# it (the write, the kernel, the client's own loop). Per request they add up to hop_out_ms.
OUT_LEGS = ("hop_out_sender_ms", "hop_out_loop_ms", "hop_out_read_ms")


def _whole(stamps: dict[str, int], stages: tuple[str, ...]) -> list[int] | None:
    """The stamps of `stages` in their order, where the server wrote every one."""
    return [stamps[s] for s in stages] if all(s in stamps for s in stages) else None


def _http_stamps(trace: Path, ids: set[str], stages: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Per request id, its server's stamps of `stages` (a server that wrote none, an older
    one or another framework's: none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from tracing.reader import Trace, TraceError

    try:
        t = Trace.open(trace).table("timeline", ["request_id", "stage", "ts_ns"])
    except TraceError:
        return {}
    t = t.filter(pc.is_in(t["stage"].cast(pa.string()), pa.array(list(stages))))
    got: dict[str, dict[str, int]] = {}
    for r in t.to_pylist():
        if r["request_id"] in ids:
            got.setdefault(r["request_id"], {})[str(r["stage"])] = r["ts_ns"]
    return got


def render_server_side(s: dict[str, Any]) -> str:
    w = 50
    lines = [f"{' Server side (mstrace trace) ':=^{w}}", f"{'Requests matched in the trace:':<40}{s['matched']}/{s['of']}"]
    for key, label in (("server_ttft_ms", "server TTFT"), ("hop_ttft_ms", "client - server TTFT"),
                       ("hop_in_ms", "hop in: send -> submit"), ("hop_in_client_ms", "  send -> written"),
                       ("hop_in_socket_ms", "  written -> read"),
                       ("hop_in_parse_ms", "  read -> parsed"), ("hop_in_route_ms", "  parsed -> route"),
                       ("hop_in_submit_ms", "  route -> submit"), ("hop_out_ms", "hop out: token -> read"),
                       ("hop_out_sender_ms", "  collected -> posted"), ("hop_out_loop_ms", "  posted -> handed"),
                       ("hop_out_read_ms", "  handed -> read"),
                       ("server_e2el_ms", "server E2EL"), ("hop_e2el_ms", "client - server E2EL")):
        if (key in IN_LEGS and not s.get("hop_in_legs_of")) or (key in OUT_LEGS and not s.get("hop_out_legs_of")):
            continue  # a server that stamps no HTTP times (another framework, an older mstrace)
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(f"{f'{name} {label} (ms):':<40}{s[key][stat]:<10.3f}")
    lines.append(f"{'Min client - server TTFT (ms):':<40}{s['hop_ttft_min_ms']:<10.3f}")
    lines.append("=" * w)
    return "\n".join(lines)


def strict_json(obj: Any) -> Any:
    """`obj` as strict JSON takes it: an empty distribution's NaN is null, an infinite rate
    "inf" (vLLM's spelling); json.dumps wrote NaN and Infinity, which JSON parsers refuse."""
    if isinstance(obj, float) and not np.isfinite(obj):
        return None if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict_json(v) for v in obj]
    return obj
