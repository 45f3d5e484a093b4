"""A small trace with fixed numbers, written through the store's own writer, for the
TUI's snapshots and window checks (a real run's timings differ every time)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from probes import boundaries as B
from tracing.writer import TraceWriter

T0 = 10**12  # the trace clock at the first round
MS = 1_000_000
ROUND_NS = 10 * MS


def synthetic_trace(root: Path, rounds: int = 60, requests: int = 12, stall: bool = False, leak: bool = False,
                    complete: bool = True, flushes: int = 3, on_flush: Callable[[int], None] | None = None) -> Path:
    """`on_flush(k)` runs after the k-th commit (a reader opening the trace while it is written)."""
    w = TraceWriter(root, flush_interval_s=3600)
    meta = {"tool": "mstrace", "model": {"name": "tiny", "kv_blocks": 256},
            "config": {"mode": "serial", "cpu_device": "process", "device": "cpu", "model": "tiny"},
            "clock": {"name": "CLOCK_MONOTONIC", "anchor_monotonic_ns": T0 - 5_000 * MS, "anchor_unix_ns": 0},
            "host": {"device": "cpu"}}
    w.write_meta(meta)
    steps, probes, reqs, mem, stalls = (w.buffer(n) for n in ("steps", "probes", "requests", "memory", "stalls"))
    held: dict[str, list[int]] = {}
    per_flush = -(-rounds // flushes)
    for i in range(rounds):
        s = T0 + i * ROUND_NS
        slow = 3 * MS if i % 10 == 7 else 0  # every tenth round waits longer for the device
        steps.append((i, "serial", s, 9 * MS + slow, 3 * MS, 6 * MS + slow, 1 if i % 5 == 0 else 0,
                      64 if i % 5 == 0 else 0, 8, 8, 40 + i % 7, 216 - i % 7, i % 3, 8, 0, s + 8 * MS + slow,
                      i % 4))
        probes.extend([
            (s, 1 * MS, B.BATCH_PREPARE, "host", 0, i),
            (s + 1 * MS, 6 * MS + slow, B.SCHEDULER_BARRIER, "host", 0, i),
            (s + 1 * MS, 6 * MS + slow, B.DEVICE_COMPUTE, "main", 0, i),
            (s + 7 * MS + slow, 1 * MS, B.BOOKKEEPING, "host", 0, i),
            (s + 8 * MS + slow, MS // 5, B.RESPONSE_SEND, "host", 0, i),
            (s + 9 * MS + slow, MS // 2, B.RESPONSE_DELIVER, "sender", 0, i),
        ])
        if i == 0:
            mem.append((s, 0, "snapshot_begin", -1, "", 256))
        if i < requests:
            rid = f"req-{i}"
            held[rid] = [2 * i, 2 * i + 1]
            mem.extend((s + MS, i, "alloc", b, rid, 1) for b in held[rid])
        done = i - 30
        if 0 <= done < requests:
            rid = f"req-{done}"
            arrival = T0 + done * ROUND_NS
            reqs.append((rid, [1] * 20, [2] * 30, "", 20, 30, 16 * (done % 2), "length", "", arrival, arrival + MS,
                         arrival + MS, arrival + 2 * MS, arrival + 2 * MS, arrival + (20 + 3 * done) * MS, s, 0, 1,
                         [ROUND_NS + (k % 3) * MS for k in range(29)], [done, 30], s + MS, []))
            if not (leak and done == 3):
                mem.extend((s + 2 * MS, i, "free", b, rid, 0) for b in held.pop(rid))
        if stall and i == rounds - 1:
            stalls.append((s + 2_000 * MS, 0, i, "scheduler", "prefill stream event", "prefill stream", B.STREAM_WAIT,
                           2_000 * MS, "scheduler -> prefill stream event -> prefill stream -> main stream event -> "
                           "scheduler", "[]", "[]", "[]", "{}", "[]"))
        if (i + 1) % per_flush == 0:
            w.flush()
            if on_flush is not None:
                on_flush((i + 1) // per_flush)
    w.close({**meta, "run": {"status": "stalled" if stall else "complete", "detail": "", "submitted": requests}}
            if complete else None)
    return root
