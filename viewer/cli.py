"""The mstrace command line. Analyses never import torch; only `run` does, lazily."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

app = typer.Typer(
    name="mstrace",
    help="Capture and analyse LLM-inference scheduler traces.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """Capture and analyse LLM-inference scheduler traces."""


def fail(msg: str, code: int = 2) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _range(text: str, name: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition("-")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        fail(f"--{name} must look like 16-512 or 64, got {text!r}")
    if a < 1 or b < a:
        fail(f"--{name} must satisfy 1 <= min <= max, got {text!r}")
    return a, b


def _delays(specs: list[str]) -> tuple[tuple[str, float], ...]:
    from scheduler.debug_delay import parse

    try:
        return parse(specs)
    except ValueError as e:
        fail(str(e))


@app.command()
def run(
    model: Annotated[str, typer.Option(help="Preset name (tiny, default, ...) or a local HF Llama-family folder.")] = "default",
    workload: Annotated[Path | None, typer.Option(help="JSONL workload file; otherwise a synthetic one.")] = None,
    requests: Annotated[int, typer.Option(help="Synthetic: number of requests.")] = 64,
    prompt_len: Annotated[str, typer.Option(help="Synthetic: prompt length range, MIN-MAX tokens.")] = "32-256",
    output_len: Annotated[str, typer.Option(help="Synthetic: output length range, MIN-MAX tokens.")] = "32-128",
    shared_prefix: Annotated[float, typer.Option(help="Synthetic: fraction of requests sharing one system prompt.")] = 0.25,
    rate: Annotated[float, typer.Option(help="Synthetic: Poisson arrival rate in requests/s; 0 = all at t=0.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed for the synthetic workload and unseeded sampling.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Trace directory (default: a new folder under traces/).")] = None,
    mode: Annotated[str, typer.Option(help="serial, timeslice, overlap, or all (the three, one after another).")] = "serial",
    prefill_chunk: Annotated[int, typer.Option(help="Max prefill tokens per round (chunked prefill).")] = 512,
    timeslice_chunk: Annotated[int, typer.Option(help="timeslice mode: prefill tokens per cycle.")] = 256,
    overlap_schedule: Annotated[bool | None, typer.Option("--overlap-schedule/--no-overlap-schedule", help="(a) prepare round N+1 while the device runs N [default: on in overlap mode].")] = None,
    split_streams: Annotated[bool | None, typer.Option("--split-streams/--no-split-streams", help="(b) decode on main, prefill on its own stream [default: on in overlap mode].")] = None,
    prefill_stagger_us: Annotated[float, typer.Option(help="(c) delay prefill work after decode work, in us.")] = 0.0,
    decode_max_wait_ms: Annotated[float, typer.Option(help="A decode waiting this long gets a decode-only round.")] = 500.0,
    prefill_max_wait_ms: Annotated[float, typer.Option(help="A prefill waiting this long for blocks evicts decodes.")] = 2000.0,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    kv_blocks: Annotated[int | None, typer.Option(help="KV pool size in blocks.")] = None,
    kv_bytes: Annotated[str | None, typer.Option(help="KV pool size in bytes (e.g. 256MiB).")] = None,
    max_running: Annotated[int, typer.Option(help="Max requests in the running queue.")] = 256,
    no_prefix_sharing: Annotated[bool, typer.Option("--no-prefix-sharing", help="Disable shared prefix blocks.")] = False,
    kv_layout: Annotated[str, typer.Option(help="paged (scattered blocks) or contiguous (one run per request; fragments, defragments).")] = "paged",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    device_threads: Annotated[int, typer.Option(help="CPU intra-op threads for the model (0 = cores - 1).")] = 0,
    cpu_device: Annotated[str, typer.Option(help="CPU only: process (the device has its own interpreter, as a GPU runs apart from the host), thread (stream threads share the scheduler's GIL), or auto (process, unless --tp/--pp need thread).")] = "auto",
    save_workload: Annotated[Path | None, typer.Option(help="Also write the workload that ran as JSONL.")] = None,
    no_probes: Annotated[bool, typer.Option("--no-probes", help="No probes/memory tables (requests stay).")] = False,
    wait_timeout: Annotated[float, typer.Option(help="Timeout in seconds of every wait in the engine.")] = 5.0,
    snapshot_every: Annotated[int, typer.Option(help="Full block-table snapshot every N rounds (0 = never).")] = 50,
    debug_delay_ms: Annotated[list[str] | None, typer.Option(hidden=True, help="Test-only: PLACE=MS, a known delay (repeatable).")] = None,
    inject: Annotated[list[str] | None, typer.Option(help="Fault injection: deadlock, leak, slow-sender, starve, stall-rank (repeatable).")] = None,
    no_gc: Annotated[bool, typer.Option("--no-gc", help="Turn off the GC scan, so a leak stays visible.")] = False,
    gc_after_s: Annotated[float, typer.Option(help="GC reclaims blocks of dead or stuck holders after this long.")] = 10.0,
    on_stall: Annotated[str, typer.Option(help="abort (flush the trace, exit 3) or continue, when a wait passes --wait-timeout.")] = "abort",
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks (gloo on CPU, nccl on CUDA); this process is rank 0.")] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline-parallel stages; --tp x --pp ranks in all.")] = 1,
    comm_overlap: Annotated[str, typer.Option(help="on: hide each TP all-reduce behind the other half of the batch; off: synchronous.")] = "on",
    pp_microbatches: Annotated[int, typer.Option(help="--pp > 1: pipeline each round's batch in 1 or 2 parts (2: the next stage computes the first half while this one computes the second).")] = 2,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    otlp_endpoint: Annotated[str | None, typer.Option(help="Also send request spans to this OTLP/HTTP collector (e.g. http://localhost:4318); needs mstrace\\[otlp].")] = None,
) -> None:
    """Run a workload through the reference engine and write a trace."""
    from viewer.run_command import RunArgs, execute_run

    if comm_overlap not in ("on", "off"):
        fail(f"--comm-overlap must be on or off, got {comm_overlap!r}")
    args = RunArgs(
        model=model, workload=workload, requests=requests, prompt_len=_range(prompt_len, "prompt-len"),
        output_len=_range(output_len, "output-len"), shared_prefix=shared_prefix, rate=rate, seed=seed,
        out=out or Path("traces") / datetime.now().strftime("run-%Y%m%d-%H%M%S"), mode=mode,
        prefill_chunk=prefill_chunk, block_size=block_size, kv_blocks=kv_blocks, kv_bytes=kv_bytes,
        max_running=max_running, prefix_sharing=not no_prefix_sharing, device=device,
        device_threads=device_threads, cpu_device=cpu_device, save_workload=save_workload, quiet=quiet, probes=not no_probes,
        wait_timeout=wait_timeout, snapshot_every=snapshot_every,
        debug_delay_ms=_delays(debug_delay_ms or []),
        otlp_endpoint=otlp_endpoint,
        timeslice_chunk=timeslice_chunk, overlap_schedule=overlap_schedule, split_streams=split_streams,
        prefill_stagger_us=prefill_stagger_us, decode_max_wait_ms=decode_max_wait_ms,
        prefill_max_wait_ms=prefill_max_wait_ms, inject=tuple(inject or ()), gc=not no_gc,
        gc_after_s=gc_after_s, on_stall=on_stall, kv_layout=kv_layout,
        tp=tp, pp=pp, comm_overlap=comm_overlap == "on", pp_microbatches=pp_microbatches,
    )
    execute_run(args, console, fail)


@app.command()
def report(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run`.")],
    json_out: Annotated[bool, typer.Option("--json", help="Plain JSON instead of tables.")] = False,
) -> None:
    """Where each scheduling cycle's time goes: sync-cost table, throughput and latency, KV usage."""
    import json

    from tracing.reader import TraceError
    from viewer.report import build_report, render_report

    try:
        rep = build_report(trace)
    except TraceError as e:
        fail(str(e))
    if json_out:
        print(json.dumps(rep, indent=2))
    else:
        render_report(console, rep)


@app.command()
def stalls(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run`.")],
    json_out: Annotated[bool, typer.Option("--json", help="Plain JSON instead of tables.")] = False,
) -> None:
    """Waits the stall watchdog caught: the wait cycle, each stream's state, thread stacks, the KV pool."""
    import json

    from tracing.reader import Trace, TraceError
    from viewer.analysis.stalls import name_missing_ranks, stall_records
    from viewer.report import status_line
    from viewer.stalls_view import render_stalls

    try:
        tr = Trace.open(trace)
        # A trace written before the stalls table existed has no folder for it: no stalls recorded.
        recs = stall_records(tr.table("stalls")) if tr.has_table("stalls") else []
        tp = int((tr.meta.get("parallel") or {}).get("tp", 1))
        if recs and tp > 1 and tr.has_table("collectives"):
            name_missing_ranks(recs, tr.table("collectives"), tp)
    except TraceError as e:
        fail(str(e))
    if json_out:
        print(json.dumps({"trace": str(trace), "status": tr.status.to_dict(), "count": len(recs),
                          "stalls": [r.to_dict() for r in recs]}, indent=2))
    else:
        status_line(console, tr.status.to_dict(), str(trace))
        render_stalls(console, str(trace), tr.meta, recs)


@app.command()
def leaks(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run`.")],
    json_out: Annotated[bool, typer.Option("--json", help="Plain JSON instead of tables.")] = False,
) -> None:
    """KV blocks still held at the end by finished requests, reclaimed blocks, and fragmentation over time."""
    import json

    from tracing.consistency import read_consistent
    from tracing.reader import Trace, TraceError
    from viewer.analysis.leaks import leak_report
    from viewer.report import status_line
    from viewer.stalls_view import render_leaks

    try:
        tr = Trace.open(trace)
        t = read_consistent(tr, {"memory": None, "requests": ["request_id", "finish_reason"]},
                            dictionary={"memory": ("request_id",)})
        rep = leak_report(t["memory"], t["requests"], int(tr.meta.get("model", {}).get("kv_blocks") or 0),
                          run_ended=tr.status.complete)
    except TraceError as e:
        fail(str(e))
    if json_out:
        print(json.dumps({"trace": str(trace), "status": tr.status.to_dict(), **rep.to_dict()}, indent=2))
    else:
        status_line(console, tr.status.to_dict(), str(trace))
        render_leaks(console, str(trace), tr.meta, rep)


@app.command()
def compact(
    trace: Annotated[Path, typer.Argument(help="Trace directory written by `mstrace run`.")],
) -> None:
    """Merge a trace's many small parts into few large ones (a killed run's, or an older version's)."""
    from tracing.compact_trace import compact_trace
    from tracing.reader import TraceError

    try:
        res = compact_trace(trace)
    except TraceError as e:
        fail(str(e))
    console.print(f"{trace}: {res.parts_before} parts -> {res.parts_after} ({res.merges} merges); "
                  f"removed {res.removed} uncommitted files", highlight=False)


@app.command()
def diff(
    a: Annotated[Path, typer.Argument(help="Baseline trace directory (A).")],
    b: Annotated[Path, typer.Argument(help="Trace directory to compare with A (B).")],
    json_out: Annotated[bool, typer.Option("--json", help="Plain JSON instead of tables.")] = False,
) -> None:
    """Did a change pay? B - A for per-boundary cost, device idle and serving metrics, with 95% bootstrap intervals."""
    import json

    from tracing.reader import TraceError
    from viewer.diff import build_diff, render_diff

    try:
        d = build_diff(a, b)
    except TraceError as e:
        fail(str(e))
    if json_out:
        print(json.dumps(d, indent=2))
    else:
        render_diff(console, d)


def main() -> None:
    app()  # typer turns Ctrl-C into exit code 130


if __name__ == "__main__":
    main()
