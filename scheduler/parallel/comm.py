"""The tensor-parallel all-reduce, observable: every collective is numbered, timed and waited on
through :func:`probes.waits.timed_wait`, so a stalled rank shows up in the wait registry as
``rank0 waits for all_reduce #17 (tp group)`` and the stall can name the collective some peer
never joined (the idea of NCCL's flight recorder: ``records`` keeps the last few thousand).

Timestamps, per collective (:class:`CollectiveRecord`):

* ``issue_ns``: the host enqueued the op (``async_op=True``);
* ``start_ns``: the transport started.  ProcessGroupGloo exposes no start event (the op sits in
  its worker queue, and with more than one collective in flight the wait for a worker is not
  observable), so on gloo ``start_ns == issue_ns`` and ``end_ns - start_ns`` includes the queueing;
* ``end_ns``: completion, from a callback on the work's future (run by gloo's worker thread), so
  it is the real completion even when nobody is waiting yet (overlap).  The callback is Python:
  it needs the GIL, so it lands late when the forward thread holds it (``end_ns`` is then an
  upper bound), and it costs the worker thread a GIL acquisition per collective;
  ``track_completion=False`` drops it and ``end_ns`` becomes the end of the host wait;
* ``wait_ns``: how long the host blocked in :meth:`AllReduce.wait`, the exposed part.

The probe row per collective is the host wait, ``(wait_start_ns, wait_ns, "all_reduce", "comm",
rank, step)``: the cost table treats ``all_reduce`` as a host boundary on the scheduling thread,
and with comm/compute overlap only the wait is a cost (the transfer behind compute is hidden).
A synchronous collective (``overlapped=False``, :meth:`AllReduce.__call__`) has nothing
independent between its issue and its wait, so its row starts at ``issue_ns``: the gap (Python
overhead, the GIL, a descheduled thread; measured at 0.1-2 ms on 2 busy cores) is exposed too,
not compute.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from probes.boundaries import ALL_REDUCE
from probes.clock import now_ns
from probes.recorder import ProbeRow
from probes.waits import WaitRegistry, timed_wait

# Longer than probes.waits.DEFAULT_TIMEOUT_S: a collective also absorbs skew between ranks (one
# still loading weights, or a long prefill on a slow core), not only the transfer.
COMM_TIMEOUT_S = 30.0
COMM_STREAM = "comm"  # probes-table stream of collective and pipeline-transfer waits
HISTORY = 4096  # collectives kept in AllReduce.records


@dataclass(slots=True)
class CollectiveRecord:
    seq: int  # per-group sequence number, identical on every rank for the same collective
    step: int
    numel: int
    overlapped: bool  # issued with independent compute behind it; False: issue-then-wait
    issue_ns: int
    start_ns: int  # == issue_ns on gloo (see module docstring)
    end_ns: int = -1  # completion; -1 while in flight
    wait_ns: int = -1  # host time blocked in wait(); -1 until waited


@dataclass(slots=True)
class PendingAllReduce:
    """A collective in flight; ``tensor`` holds the sum once :meth:`AllReduce.wait` returns."""

    tensor: torch.Tensor
    work: dist.Work
    record: CollectiveRecord


class AllReduce:
    """Sum-all-reduce over ``group`` with numbered, timed, registered waits.

    ``issue`` / ``wait`` split a collective for overlap; calling the object is the synchronous
    form and is what :class:`~scheduler.model.layers.DecoderLayer` takes as its hook.  One
    instance per TP group per process, used from one thread (the one running the forward).
    """

    __slots__ = (
        "group", "rank", "buf", "registry", "timeout_s", "step", "issued", "records",
        "track_completion", "before_issue", "_inflight", "_host_blocking",
    )

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        *,
        buf: list[ProbeRow] | None = None,
        registry: WaitRegistry | None = None,
        timeout_s: float = COMM_TIMEOUT_S,
        history: int = HISTORY,
        track_completion: bool = True,
    ) -> None:
        self.group = group
        self.rank = rank
        self.buf = buf
        self.registry = registry if registry is not None else WaitRegistry()
        self.timeout_s = timeout_s
        self.step = -1  # the engine step the next collectives belong to (probe rows)
        self.issued = 0  # also the next sequence number
        self.records: deque[CollectiveRecord] = deque(maxlen=history)
        self.track_completion = track_completion
        # Called with the sequence number before each collective is issued. Fault injection
        # (--inject stall-rank) hangs here, so the peers' waits name the collective it never joined.
        self.before_issue: Callable[[int], None] | None = None
        self._inflight: dict[int, PendingAllReduce] = {}
        # gloo's work.wait blocks the host (with a timeout); nccl's only orders the current
        # stream after the collective and returns at once, so it needs no slicing.
        self._host_blocking = dist.get_backend(group) != "nccl"

    def issue(self, t: torch.Tensor, *, overlapped: bool = True) -> PendingAllReduce:
        """Start summing ``t`` in place across the group; ``t`` must not be read until waited."""
        seq = self.issued
        if self.before_issue is not None:
            self.before_issue(seq)
        self.issued += 1
        ts = now_ns()
        rec = CollectiveRecord(seq, self.step, t.numel(), overlapped, ts, ts)
        work = dist.all_reduce(t, group=self.group, async_op=True)
        assert work is not None  # async_op=True always returns a Work

        if self.track_completion:

            def done(_: object) -> None:
                if rec.end_ns < 0:
                    rec.end_ns = now_ns()

            work.get_future().add_done_callback(done)
        pending = PendingAllReduce(t, work, rec)
        self._inflight[seq] = pending
        self.records.append(rec)
        return pending

    def wait(self, p: PendingAllReduce) -> torch.Tensor:
        """Block (timed, registered, probed) until ``p`` completes; returns the summed tensor."""
        seq = p.record.seq
        p.record.wait_ns = timed_wait(
            work_ready(p.work, self._host_blocking),
            registry=self.registry,
            waiter=f"rank{self.rank}",
            what=f"all_reduce #{seq}",
            signaller="tp group",
            boundary=ALL_REDUCE,
            timeout_s=self.timeout_s,
            stream=COMM_STREAM,
            rank=self.rank,
            step=self.step,
        )
        t1 = now_ns()
        if p.record.end_ns < 0:  # untracked, or the callback still waits for the GIL
            p.record.end_ns = t1
        if self.buf is not None:
            t0 = t1 - p.record.wait_ns if p.record.overlapped else p.record.issue_ns
            self.buf.append((t0, t1 - t0, ALL_REDUCE, COMM_STREAM, self.rank, self.step))
        del self._inflight[seq]
        return p.tensor

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.wait(self.issue(t, overlapped=False))

    def in_flight(self) -> list[int]:
        """Sequence numbers issued but not yet waited (what a stall report names)."""
        return sorted(self._inflight)


def work_ready(work: dist.Work, host_blocking: bool = True) -> Callable[[float], bool]:
    """Adapt a c10d ``Work`` to :func:`probes.waits.timed_wait`'s ``ready(slice_s)``."""

    def ready(slice_s: float) -> bool:
        if work.is_completed():
            work.wait()  # re-raises the op's error, if it failed
            return True
        if slice_s <= 0:
            return False
        if not host_blocking:  # nccl: wait() only orders the current stream, never blocks
            work.wait()
            return True
        try:
            # Never 0: a zero timeout means "no timeout" to c10d and would block forever.
            work.wait(timeout=timedelta(seconds=max(slice_s, 1e-3)))
        except RuntimeError:
            if work.is_completed():
                # Done after all: the peer finished just as the slice expired (then this
                # returns), or the op really failed, e.g. the peer is gone (then it re-raises).
                work.wait()
                return True
            return False  # on gloo the group stays usable after a timed-out wait
        return True

    return ready


def p2p_ready(work: dist.Work, timeout_s: float, host_blocking: bool = True) -> Callable[[float], bool]:
    """:func:`work_ready` for a point-to-point send or receive, which gloo cannot wait for in
    slices: a timed-out ``wait`` fails a p2p work and closes the connection to the peer
    ("Application timeout caused pair closure"; its ``is_completed`` also only changes inside
    ``wait``).  So the first blocking call waits for the whole of ``timeout_s`` at once; the
    wait is registered before it starts, so the stall watchdog still sees it live.
    """
    deadline = now_ns() + int(timeout_s * 1e9)

    def ready(slice_s: float) -> bool:
        left = (deadline - now_ns()) / 1e9
        if left <= 0:  # timed out: leave the failed work alone, timed_wait raises WaitTimeout
            time.sleep(min(max(slice_s, 0.0), 1e-3))
            return False
        if work.is_completed():
            work.wait()  # re-raises the op's error, if it failed
            return True
        if slice_s <= 0:
            return False
        if not host_blocking:  # nccl: wait() only orders the current stream, never blocks
            work.wait()
            return True
        try:
            work.wait(timeout=timedelta(seconds=max(left, 1e-3)))
        except RuntimeError:
            if now_ns() >= deadline:
                return False
            raise  # a real failure (peer gone)
        return True

    return ready
