"""Drive a workload through an Engine: arrivals on their own thread, rounds on
the calling thread, finished requests into the trace's requests table."""

from __future__ import annotations

import os
import platform
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from probes.clock import clock_record, now_ns, wall_anchor
from probes.cpu import cpu_record, sample_cpu
from scheduler.config import EngineConfig
from scheduler.engine import Engine, StepStats
from scheduler.harness.workload import WorkloadItem, workload_digest
from scheduler.hops.sender import FinishedRecord
from scheduler.model.dtypes import name_of
from tracing.run_status import first_line
from tracing.writer import TraceWriter


class RequestsRow(NamedTuple):
    """A requests-table row: the schema's columns in order (tests/test_store.py checks)."""

    request_id: str
    input_ids: list[int]
    output_ids: list[int]
    output_text: str
    prompt_len: int
    output_len: int
    cached_prefix_len: int
    finish_reason: str
    finish_detail: str
    arrival_ns: int
    tokenized_ns: int
    queued_ns: int
    admitted_ns: int
    first_scheduled_ns: int
    first_token_ns: int
    finish_ns: int
    num_preemptions: int
    num_prefill_chunks: int
    dur_itl_ns: list[int]
    token_runs: list[int]
    delivered_ns: int
    preempt_reasons: list[str]


class TraceRequestsSink:
    """Writes one requests-table row per finished request (runs on the sender thread)."""

    def __init__(self, writer: TraceWriter) -> None:
        self._buf = writer.buffer("requests")

    def on_text(self, request_id: str, text: str) -> None:
        pass

    def on_finish(self, r: FinishedRecord, text: str) -> None:
        self._buf.append(RequestsRow(
            r.request_id, r.input_ids, r.output_ids, text, len(r.input_ids), len(r.output_ids),
            r.cached_prefix_len, r.finish_reason, r.finish_detail, r.arrival_ns, r.tokenized_ns,
            r.queued_ns, r.admitted_ns, r.first_scheduled_ns, r.first_token_ns, r.finish_ns,
            r.num_preemptions, r.num_prefill_chunks,
            [b - a for a, b in zip(r.token_ns, r.token_ns[1:], strict=False)],  # ITL gaps, off the hot path
            r.token_runs,
            now_ns(),  # delivered: this sink runs as the sender hands the request's end to the client
            r.preempt_reasons,
        ))


@dataclass(slots=True)
class RunResult:
    start_ns: int
    end_ns: int
    steps: int
    requests: int
    # CPU time spent from start_ns to end_ns (probes.cpu.cpu_record; meta.json run.cpu),
    # set once the run has ended cleanly
    cpu: dict[str, Any] | None = None


class RunFailed(RuntimeError):
    """A thread of the run failed; the message is one line."""


def run_workload(
    engine: Engine,
    items: list[WorkloadItem],
    on_round: Callable[[StepStats], None] | None = None,
    idle_poll_s: float = 0.02,
    result: RunResult | None = None,
) -> RunResult:
    """`result`, when given, is kept up to date as the run goes, so a caller whose
    run ends in an exception still knows when it started and how far it got."""
    cpu0 = sample_cpu()  # before the clock read: the window is then [start, end] or a little wider
    start = now_ns()
    res = result if result is not None else RunResult(start, 0, 0, len(items))
    res.start_ns, res.requests = start, len(items)
    stop = threading.Event()
    failed: list[BaseException] = []

    def feed() -> None:
        try:
            for it in sorted(items, key=lambda i: i.arrival_s):
                delay_ns = start + int(it.arrival_s * 1e9) - now_ns()
                if delay_ns > 0 and stop.wait(delay_ns / 1e9):
                    return
                engine.submit(it.prompt if it.prompt is not None else list(it.input_ids or ()),
                              it.params, it.request_id, add_special_tokens=it.add_special_tokens)
        except BaseException as e:  # noqa: BLE001 - the run stops with it (below)
            failed.append(e)

    feeder = threading.Thread(target=feed, name="arrivals", daemon=True)
    feeder.start()

    def arriving() -> bool:
        if failed:  # the run stops with the arrivals, not after the work they left
            raise RunFailed(f"the arrivals thread failed: {first_line(failed[0])}") from failed[0]
        return feeder.is_alive()

    def counted(stats: StepStats) -> None:
        res.steps += 1
        if on_round is not None:
            on_round(stats)

    try:
        engine.drive(arriving, counted, idle_poll_s)
    finally:
        stop.set()
        feeder.join()
        res.end_ns = now_ns()
    res.cpu = cpu_record(cpu0, sample_cpu())
    return res


def start_meta(
    cfg: EngineConfig, items: list[WorkloadItem], workload_source: str, anchor: tuple[int, int]
) -> dict[str, Any]:
    """What meta.json can say before the engine exists: a run killed while it loads
    its model still leaves a trace that reads (truncated, with no rounds)."""
    mono, unix = anchor
    return {
        "tool": "mstrace",
        "config": cfg.to_dict(),
        # a server's workload is whatever arrives: no digest (two served traces are not one workload)
        "workload": {"source": workload_source, "requests": len(items),
                     "digest": workload_digest(items) if items else None},
        "clock": clock_record((mono, unix)),
    }


def run_meta(
    engine: Engine, items: list[WorkloadItem], workload_source: str, anchor: tuple[int, int] | None = None
) -> dict[str, Any]:
    mc = engine.model_config
    # ranks (clock offsets) and parallel (sizes, backend) of a TP/PP run
    par = engine.parallel.meta() if engine.parallel is not None else {"ranks": {"0": {"offset_ns": 0}}}
    return {
        **start_meta(engine.cfg, items, workload_source, anchor or wall_anchor()),
        "model": {
            "path": str(engine.model_dir),
            "name": engine.cfg.model,
            "architecture": mc.architecture,
            "num_layers": mc.num_hidden_layers,
            "hidden_size": mc.hidden_size,
            "vocab_size": mc.vocab_size,
            "kv_blocks": engine.mm.num_blocks,
            "block_size": engine.mm.block_size,
            "dtype": name_of(engine.backend.dtype),  # what ran, which may differ from the checkpoint's
            "dtype_choice": engine.backend.dtype_why,
            "weight_pack": engine.backend.pack.packed,
            "weight_pack_choice": engine.backend.pack.why,
            "pages": engine.backend.pages,
            "primitive_cache": engine.backend.primitive_cache,
            "checkpoint_dtype": name_of(mc.torch_dtype),
            "max_position_embeddings": mc.max_position_embeddings,
        },
        "versions": {
            "mstrace": _version(),
            "python": sys.version.split()[0],
            # from the installed packages' metadata: importing transformers to ask would cost a second
            **{pkg: _version(pkg) for pkg in ("torch", "transformers", "tokenizers")},
        },
        "host": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "device": str(engine.device),
            "device_threads": engine.cfg.resolved_device_threads() if engine.device.type == "cpu" else None,
        },
        "contention": engine.contention,  # scheduler/device/contention.py
        **par,
        **engine.hooks.meta(),
    }


def _version(package: str = "mstrace") -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001 - running from a source tree, or the package is absent
        return "0+unknown"
