"""How much the host and the device slow each other, measured once at start-up (docs/whatif.md).

On a GPU the device computes beside the host. The CPU emulation shares the machine: a
device process competes for the cores, a device thread also for the GIL, so host work done
while a batch runs makes the batch longer, and the batch makes the host's work longer.
`mstrace whatif` needs both to predict an overlap run from a serial one (whose host never
works beside its device) and back.

The probe runs the engine's own forward on a small decode batch on the main stream, alone,
and then with the host building forward batches (the host's batch_prepare) at the same
time. While both work, each keeps a share of its own speed, its rate (`rates`): 1 untouched,
0 stopped (`rates`, over one forward repeated for about SPAN_NS). The medians of `ROUNDS`
alternated measurements go to meta.json. The probe leaves
no rows in the trace (it runs before the first round, with the stream's probe rows off) and
writes scratch K/V only into the pool's last blocks, which no request holds yet.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from probes.clock import now_ns
from scheduler.device.prepared import PreparedBatch
from scheduler.device.work import FUTURE_SLOTS, DeviceOps, Event, Stream
from scheduler.model.forward_batch import SeqChunk, build_forward_batch
from scheduler.model.forward_step import SamplingArgs

ROWS = 8  # decode rows of the probe's batch
CONTEXT = 64  # tokens already in each row's cache
ROUNDS = 3  # alone/beside pairs; the median is kept
HOST_SHARE = 0.5  # host work started beside each forward, as a share of the forward's span alone
# Each measurement repeats one forward, with and without host work beside it, until it spans
# this long: many GIL switch intervals (5 ms), whose phase decides a single short forward's fate.
SPAN_NS = 30_000_000
MIN_REPEATS, MAX_REPEATS = 2, 200
WAIT_S = 120.0  # a probe forward that takes longer than this is a device that hangs


@dataclass(slots=True)
class Contention:
    """What meta.json's `contention` holds: the share of its own speed each side kept while
    the other worked (1: untouched, as a GPU beside its host; a device thread and a host
    thread that take turns on one GIL sum to 1 at best, less when each turn costs a hand-over)."""

    device_rate: float  # the median of `rounds`' device rates, clipped to [0, 1]
    host_rate: float  # ... and of their host rates
    rounds: list[tuple[float, float]]  # each measurement's (device, host) rate, unclipped
    device_alone_ms: float  # one probe forward alone, its mean span in the median measurement
    device_beside_ms: float  # ... beside the host's work
    host_alone_ms: float  # the host work started beside one forward, at its own speed alone
    host_beside_ms: float  # ... as long as it took beside them, median
    probe_ms: float  # the whole probe's wall time (the start-up it cost)
    batch: str  # the probe's batch

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure(stream: Stream, ops: DeviceOps, block_size: int, num_blocks: int,
            device: Any) -> Contention:
    t_probe = now_ns()
    per_row = -(-(CONTEXT + 1) // block_size)
    if per_row * ROWS > num_blocks:
        raise ValueError(f"the KV pool's {num_blocks} blocks cannot hold the contention probe's batch")
    seqs = [SeqChunk([1], CONTEXT, list(range(num_blocks - (r + 1) * per_row, num_blocks - r * per_row)), True)
            for r in range(ROWS)]
    host_device = device if device is not None else "cpu"
    prepared = PreparedBatch(
        forward=build_forward_batch(seqs, block_size, device) if ops.builds_batch_on_host else None,
        chunks=[], sampled=[], sampling=SamplingArgs([0.0] * ROWS, [1.0] * ROWS, [None] * ROWS),
        has_placeholders=False, seqs=seqs)
    slots = list(range(FUTURE_SLOTS - ROWS, FUTURE_SLOTS))  # the ring's far end: rewritten before any read

    def host_op() -> None:
        build_forward_batch(seqs, block_size, host_device)

    with stream.unrecorded():
        one = _span(stream, ops, prepared, slots)  # also the warm-up: first-call costs, caches
        one = min(one, _span(stream, ops, prepared, slots))
        t = now_ns()
        for _ in range(20):
            host_op()
        host_each = (now_ns() - t) / 20
        reps = min(max(-(-SPAN_NS // max(one, 1)), MIN_REPEATS), MAX_REPEATS)
        n = max(1, round(HOST_SHARE * one / host_each))  # host ops beside each forward
        rounds, spans = [], []
        for _ in range(ROUNDS):
            d = sum(_span(stream, ops, prepared, slots) for _ in range(reps))
            d2 = h2 = 0
            for _ in range(reps):
                dev, host = _span_beside(stream, ops, prepared, slots, host_op, n)
                d2, h2 = d2 + dev, h2 + host
            t = now_ns()
            for _ in range(reps * n):
                host_op()
            h = now_ns() - t
            rounds.append(rates(d, h, d2, h2))
            spans.append((d / reps, d2 / reps, h / reps, h2 / reps))
    r_d, r_h = (min(max(statistics.median(r), 0.0), 1.0) for r in zip(*rounds, strict=True))
    d, d2, h, h2 = (statistics.median(x) / 1e6 for x in zip(*spans, strict=True))
    return Contention(r_d, r_h, [(round(a, 4), round(b, 4)) for a, b in rounds], d, d2, h, h2,
                      (now_ns() - t_probe) / 1e6,
                      f"one forward of {ROWS} decode rows at {CONTEXT} tokens of context, {reps} times a "
                      f"measurement, {n} host batch builds beside each")


def rates(d: float, h: float, d2: float, h2: float) -> tuple[float, float]:
    """The shares of their own speed device and host kept while both worked, from the device's
    work alone `d` and beside the host `d2`, and the host's alone `h` and beside it `h2`, both
    started together: until the first of the two ends both work; then the other works alone."""
    if h2 <= d2:  # the host ended first: the device did d - (d2 - h2) of its work beside it
        return (d - d2 + h2) / h2, h / h2
    return d / d2, (h - h2 + d2) / d2  # the device ended first


def _launch(stream: Stream, ops: DeviceOps, prepared: PreparedBatch, slots: list[int]) -> tuple[Event, Event]:
    start = stream.record()
    stream.submit(ops.forward_work(prepared, slots, -1, []), "contention-probe")
    return start, stream.record()


def _ended(start: Event, end: Event) -> int:
    if not end.wait(WAIT_S):
        raise RuntimeError(f"the contention probe's forwards did not end within {WAIT_S:g} s")
    s, e = start.ts_ns, end.ts_ns
    assert s is not None and e is not None, "a completed event has its time"
    return e - s


def _span(stream: Stream, ops: DeviceOps, prepared: PreparedBatch, slots: list[int]) -> int:
    return _ended(*_launch(stream, ops, prepared, slots))


def _span_beside(stream: Stream, ops: DeviceOps, prepared: PreparedBatch, slots: list[int],
                 host_op: Callable[[], None], n: int) -> tuple[int, int]:
    """The device's span with `n` host ops started beside it, and how long those took."""
    start, end = _launch(stream, ops, prepared, slots)
    t0 = now_ns()
    for _ in range(n):
        host_op()
    host = now_ns() - t0
    return _ended(start, end), host
