"""How much the host and the device slow each other, measured once at start-up (docs/whatif.md).

On a GPU the device computes beside the host. The CPU emulation shares the machine: a
device process competes for the cores, a device thread also for the GIL, so host work done
while a batch runs makes the batch longer, and the batch makes the host's work longer.
`mstrace whatif` needs both to predict an overlap run from a serial one (whose host never
works beside its device) and back.

The probe runs the engine's own forward on a small decode batch on the main stream, alone,
and then with host work beside it, of two kinds (`Contention`): the host's batch_prepare
(building forward batches; for a device process, the launch's wire message) and pure Python. While both work, each side keeps a share of its
own speed, its rate (`rates`): 1 untouched, 0 stopped, measured over one forward repeated
for about SPAN_NS. The same rates between the device's own two streams: split streams
(overlap mode's (b)) run a prefill chunk on the prefill stream beside the decodes on the main
stream, which on the CPU emulation are two threads sharing the cores (and, on a device
thread, the GIL). The medians of `ROUNDS` alternated measurements go to meta.json. The
probe leaves no rows in the trace (it runs before the first round, with the streams' probe
rows off) and writes scratch K/V only into the pool's last blocks, which no request holds yet.
"""

from __future__ import annotations

import pickle
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from probes.boundaries import SCHEDULER_BARRIER
from probes.clock import now_ns
from probes.waits import WaitRegistry, timed_wait
from scheduler.device.prepared import PreparedBatch
from scheduler.device.work import FUTURE_SLOTS, MAIN, PREFILL, DeviceOps, Event, RemoteOp, Stream
from scheduler.model.forward_batch import SeqChunk, build_forward_batch
from scheduler.model.forward_step import SamplingArgs

ROWS = 64  # decode rows of the probe's batch: a mid-size one (GIL hand-overs cost more beside small ones)
CONTEXT = 128  # tokens already in each row's cache
PREFILL_TOKENS = 128  # the prefill stream's chunk: one prompt's first tokens
ROUNDS = 5  # measurements; the median of each rate is kept
HOST_SHARE = 0.5  # host work started beside each forward, as a share of the forward's span alone
# Each measurement repeats one forward, with and without host work beside it, until it spans
# this long: several GIL switch intervals (5 ms), whose phase decides a single short forward's fate.
SPAN_NS = 20_000_000
MIN_REPEATS, MAX_REPEATS = 1, 200
WAIT_S = 120.0  # a probe forward that takes longer than this is a device that hangs (WaitTimeout)


class NoRoom(Exception):
    """The KV pool is too small for the probe's batch: the run goes on unprobed."""


@dataclass(slots=True)
class Rates:
    """Beside one kind of host work: the share of its own speed each side kept while the
    other worked (1: untouched, as a GPU beside its host)."""

    device_rate: float  # the median of `rounds`' device rates, clipped to [0, 1]
    host_rate: float  # ... and of their host rates
    rounds: list[tuple[float, float]]  # each measurement's (device, host) rate, unclipped
    device_beside_ms: float  # one probe forward's mean span beside this host work (median measurement)
    host_alone_ms: float  # the host work started beside one forward, alone
    host_beside_ms: float  # ... and beside the forward


@dataclass(slots=True)
class StreamRates:
    """Between the device's two streams, both busy: the share of its own speed the main
    stream's decode forward and the prefill stream's chunk each kept (0.5 and 0.5: no faster
    together than one after the other; 1 and 1: each as fast as alone)."""

    main_rate: float  # the median of `rounds`' main rates, clipped to [0, 1]
    prefill_rate: float
    rounds: list[tuple[float, float]]  # each measurement's (main, prefill) rate, unclipped
    main_alone_ms: float  # the decode forward's mean span alone (median measurement)
    prefill_alone_ms: float  # the prefill chunk's, alone
    main_beside_ms: float  # ... and each beside the other, started together
    prefill_beside_ms: float


@dataclass(slots=True)
class Contention:
    """What meta.json's `contention` holds: the rates beside the host's two kinds of work,
    between the device's two streams, and a forward's cold start after an idle device.
    A device thread and a host thread take turns on one GIL: host work that calls into torch
    (building a batch's tensors) lets go of it at every call, so both sides slow down, their
    rates summing to about 1 (less beside a small batch, where hand-overs cost more); pure
    Python holds it, so the host keeps its speed and the device stops. A device process only
    shares the cores."""

    prepare: Rates  # beside the host building forward batches (batch_prepare)
    python: Rates  # beside pure Python (bookkeeping, the hand-off, the gap between rounds)
    streams: StreamRates  # the main stream's decodes beside the prefill stream's chunk
    device_alone_ms: float  # one probe forward's mean span alone (median measurement)
    # what a forward takes longer after the device idled while the host worked (a serial
    # round) than straight after another (overlap's back-to-back batches): its own spans
    cold_ms: float  # the median of `cold_rounds`
    cold_rounds: list[float]
    probe_ms: float  # the whole probe's wall time (the start-up it cost)
    batch: str  # the probe's batch and repeats

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _scratch_blocks(block_size: int) -> int:
    """The pool's last blocks the probe writes scratch K/V into."""
    return -(-(CONTEXT + 1) // block_size) * ROWS + -(-PREFILL_TOKENS // block_size)


def measure(streams: dict[str, Stream], ops: DeviceOps, block_size: int, num_blocks: int, device: Any,
            registry: WaitRegistry) -> Contention:
    t_probe = now_ns()
    per_row = -(-(CONTEXT + 1) // block_size)
    if _scratch_blocks(block_size) > num_blocks:
        raise NoRoom(f"the KV pool's {num_blocks} blocks cannot hold the contention probe's batch")
    seqs = [SeqChunk([1], CONTEXT, list(range(num_blocks - (r + 1) * per_row, num_blocks - r * per_row)), True)
            for r in range(ROWS)]
    low = num_blocks - per_row * ROWS  # the prefill chunk's blocks lie below the decodes'
    chunk = [SeqChunk([1] * PREFILL_TOKENS, 0, list(range(low - -(-PREFILL_TOKENS // block_size), low)), True)]
    prepared, prefill = (PreparedBatch(
        forward=build_forward_batch(q, block_size, device) if ops.builds_batch_on_host else None,
        chunks=[], sampled=[], sampling=SamplingArgs([0.0] * len(q), [1.0] * len(q), [None] * len(q)),
        has_placeholders=False, seqs=q) for q in (seqs, chunk))
    slots = list(range(FUTURE_SLOTS - ROWS, FUTURE_SLOTS))  # the ring's far end: rewritten before any read
    pre_slots = [FUTURE_SLOTS - ROWS - 1]
    stream, other = streams[MAIN], streams[PREFILL]
    kinds: dict[str, Callable[[], object]] = {"prepare": _prepare_work(ops, prepared, slots, block_size, device),
                                              "python": _python_work}
    with stream.unrecorded(), other.unrecorded():
        _span(stream, ops, registry, prepared, slots)  # the warm-up: first-call costs, caches
        _span(other, ops, registry, prefill, pre_slots)
        one = statistics.median(_span(stream, ops, registry, prepared, slots) for _ in range(3))
        per = {k: max(1, round(HOST_SHARE * one / _timed(op, 20) * 20)) for k, op in kinds.items()}  # ops per forward
        alone: list[float] = []
        cold_ms: list[float] = []
        reps: list[int] = []
        got: dict[str, list[tuple[float, ...]]] = {k: [] for k in (*kinds, "streams")}
        for _ in range(ROUNDS):
            # alone and beside interleaved forward by forward, so that a drift of the machine
            # within a measurement moves both alike; repeated until the alone forwards span SPAN_NS
            d = n = 0
            sums = {k: [0, 0, 0] for k in got}  # device beside, host (or prefill) alone, host beside
            cold = [0, 0]  # a forward's own span after an idle device, and straight after another
            while n < MAX_REPEATS and (d < SPAN_NS or n < MIN_REPEATS):
                d += _span(stream, ops, registry, prepared, slots)
                for k, op in kinds.items():
                    dev, host = _span_beside(stream, ops, registry, prepared, slots, op, per[k])
                    acc = sums[k]
                    acc[0], acc[1], acc[2] = acc[0] + dev, acc[1] + _timed(op, per[k]), acc[2] + host
                acc = sums["streams"]
                pair = _launch(stream, ops, prepared, slots), _launch(other, ops, prefill, pre_slots)
                acc[0] += _ended(stream, ops, registry, *pair[0])
                acc[2] += _ended(other, ops, registry, *pair[1])
                acc[1] += _span(other, ops, registry, prefill, pre_slots)
                # a forward after the device idled while the host worked, as a serial round's
                # host works between two forwards; then one straight after another
                for k, op in kinds.items():
                    _timed(op, per[k])  # about one forward's span of host work in all
                cold[0] += _own(stream, registry, *_launch(stream, ops, prepared, slots))
                _launch(stream, ops, prepared, slots)
                cold[1] += _own(stream, registry, *_launch(stream, ops, prepared, slots))
                n += 1
            cold_ms.append((cold[0] - cold[1]) / n / 1e6)
            alone.append(d / n)
            reps.append(n)
            for k, (d2, h, h2) in sums.items():
                got[k].append((*rates(d, h, d2, h2), d2 / n, h / n, h2 / n))
    streams_rates = _summary(got.pop("streams"))
    return Contention(**{k: _summary(v) for k, v in got.items()},
                      streams=StreamRates(streams_rates.device_rate, streams_rates.host_rate, streams_rates.rounds,
                                          statistics.median(alone) / 1e6, streams_rates.host_alone_ms,
                                          streams_rates.device_beside_ms, streams_rates.host_beside_ms),
                      device_alone_ms=statistics.median(alone) / 1e6,
                      cold_ms=statistics.median(cold_ms), cold_rounds=[round(c, 4) for c in cold_ms],
                      probe_ms=(now_ns() - t_probe) / 1e6,
                      batch=f"one forward of {ROWS} decode rows at {CONTEXT} tokens of context, {min(reps)}-"
                            f"{max(reps)} per measurement, {per['prepare']} batch_prepare and {per['python']} "
                            f"pure-Python ops beside each, or a {PREFILL_TOKENS}-token prefill chunk on the "
                            "prefill stream")


def _summary(rows: list[tuple[float, ...]]) -> Rates:
    cols = list(zip(*rows, strict=True))
    r_d, r_h = (min(max(statistics.median(c), 0.0), 1.0) for c in cols[:2])
    d2, h, h2 = (statistics.median(c) / 1e6 for c in cols[2:])
    return Rates(r_d, r_h, [(round(a, 4), round(b, 4)) for a, b, *_ in rows], d2, h, h2)


def _prepare_work(ops: DeviceOps, prepared: PreparedBatch, slots: list[int], block_size: int,
                  device: Any) -> Callable[[], object]:
    """The host's batch_prepare for this device: the forward batch's tensors, or, for a device
    process (which builds them itself), the launch's wire message."""
    if ops.builds_batch_on_host:
        return lambda: build_forward_batch(prepared.seqs, block_size, device)

    def wire() -> bytes:
        op = ops.forward_work(prepared, slots, -1, [])
        assert isinstance(op, RemoteOp)
        return pickle.dumps(op.payload, pickle.HIGHEST_PROTOCOL)

    return wire


def _python_work() -> None:
    """Pure Python of a scheduler's kind: dict and list updates, no call that lets go of the GIL."""
    seen: dict[int, int] = {}
    for i in range(400):
        seen[i % 31] = seen.get(i % 31, 0) + i
    sorted(seen.items(), key=lambda kv: -kv[1])


def _timed(op: Callable[[], object], n: int) -> int:
    t = now_ns()
    for _ in range(n):
        op()
    return now_ns() - t


def rates(d: float, h: float, d2: float, h2: float) -> tuple[float, float]:
    """The shares of their own speed device and host kept while both worked, from the device's
    work alone `d` and beside the host `d2`, and the host's alone `h` and beside it `h2`, both
    started together: until the first of the two ends both work; then the other works alone."""
    if h2 <= d2:  # the host ended first: the device did d - (d2 - h2) of its work beside it
        return (d - d2 + h2) / h2, h / h2
    return d / d2, (h - h2 + d2) / d2  # the device ended first


def _launch(stream: Stream, ops: DeviceOps, prepared: PreparedBatch, slots: list[int]) -> tuple[int, Event]:
    t = now_ns()
    stream.submit(ops.forward_work(prepared, slots, -1, []), "contention-probe")
    return t, stream.record()


def _ended(stream: Stream, ops: DeviceOps, registry: WaitRegistry, launched: int, end: Event) -> int:
    """The forward's span. A device thread's starts at the launch: waiting for the GIL to pick
    the work up is as much its slowdown as waiting for it between ops. A device process's
    starts when it started the forward: the pipe hop is the hand-over's, which a trace
    measures apart (`L`), not the device's work."""
    # a gate like the barrier's, registered for the watchdog; no row: the probe is not the run's
    timed_wait(end.wait, registry=registry, waiter="scheduler", what=f"contention probe's {end.label}",
               signaller=f"{stream.name}-stream", boundary=SCHEDULER_BARRIER, timeout_s=WAIT_S)
    if stream.error is not None:  # a stream skips its work after a failure: the run could not start
        raise RuntimeError(f"the contention probe's forward failed: {stream.error!r}") from stream.error
    e = end.ts_ns
    assert e is not None and stream.completed, "an op ran before its end event completed"
    return e - (launched if ops.builds_batch_on_host else stream.completed[-1].start_ns)


def _own(stream: Stream, registry: WaitRegistry, launched: int, end: Event) -> int:
    """The forward's own span on its stream: from its start there, waits before it excluded."""
    timed_wait(end.wait, registry=registry, waiter="scheduler", what=f"contention probe's {end.label}",
               signaller=f"{stream.name}-stream", boundary=SCHEDULER_BARRIER, timeout_s=WAIT_S)
    if stream.error is not None:
        raise RuntimeError(f"the contention probe's forward failed: {stream.error!r}") from stream.error
    op = stream.completed[-1]
    return op.end_ns - op.start_ns


def _span(stream: Stream, ops: DeviceOps, registry: WaitRegistry, prepared: PreparedBatch, slots: list[int]) -> int:
    return _ended(stream, ops, registry, *_launch(stream, ops, prepared, slots))


def _span_beside(stream: Stream, ops: DeviceOps, registry: WaitRegistry, prepared: PreparedBatch,
                 slots: list[int], host_op: Callable[[], object], n: int) -> tuple[int, int]:
    """The device's span with `n` host ops started beside it, and how long those took."""
    launched, end = _launch(stream, ops, prepared, slots)
    host = _timed(host_op, n)
    return _ended(stream, ops, registry, launched, end), host
