"""The batch description rank 0 ships to every other rank each round, as int64 tensors.

Every rank builds the same :class:`~scheduler.model.forward_batch.ForwardBatch` from the same
``SeqChunk`` list, so the wire carries exactly that list (plus what the logits rank needs to
sample), never tensors of the batch itself.  Two broadcasts per round on the control group, no
pickles (a pickle from the network is code execution, and its size is unknowable up front):

* header, fixed size: ``[code, step, num_chunks, payload_len]``;
* payload, ``payload_len`` int64 (skipped when 0), per chunk in batch order::

      n_tokens, start_pos, n_blocks, sample, token ids ..., block ids ...,
      and when sample == 1: temperature, top_p (float64 bit patterns), seed

``code`` is :data:`RUN` or :data:`STOP` (the run is over: the worker flushes and exits).
The broadcast is the ``batch_broadcast`` boundary: on rank 0 the whole send, on a worker the
part after the header arrived (the wait before it is the worker idling while rank 0 schedules,
which is rank 0's host time, not the broadcast's).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from probes.boundaries import BATCH_BROADCAST
from probes.clock import now_ns
from probes.recorder import ProbeRow
from probes.waits import WaitRegistry, timed_wait
from scheduler.model.forward_batch import SeqChunk

from .comm import COMM_STREAM, work_ready

RUN, STOP = 1, 2
HEADER = 4  # code, step, num_chunks, payload_len
# A worker waits this long for the next round: idle time (no requests), not a stall.  The control
# group is created with the same timeout, because gloo applies a group's timeout to every op.
IDLE_TIMEOUT_S = 7 * 24 * 3600.0

_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


def _f2i(x: float) -> int:
    return int(_I64.unpack(_F64.pack(float(x)))[0])


def _i2f(x: int) -> float:
    return float(_F64.unpack(_I64.pack(x))[0])


@dataclass(slots=True)
class WireBatch:
    code: int
    step: int
    seqs: list[SeqChunk] = field(default_factory=list)
    # One entry per sampled chunk, in chunk order (the logits rows' order).
    temperatures: list[float] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # for temperature > 0 rows; 0 otherwise


def encode(b: WireBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) int64 tensors for ``b``."""
    out: list[int] = []
    sampled = iter(zip(b.temperatures, b.top_ps, b.seeds, strict=True))
    for c in b.seqs:
        if min(c.token_ids) < 0:
            # A placeholder token lives in rank 0's future ring only: overlap scheduling is off
            # with tp * pp > 1 (EngineConfig.validate), so this is a bug, not an input error.
            raise ValueError("placeholder token ids cannot be broadcast")
        out += (len(c.token_ids), c.start_pos, len(c.block_table), int(c.sample))
        out += c.token_ids
        out += c.block_table
        if c.sample:
            t, p, s = next(sampled)
            out += (_f2i(t), _f2i(p), s)
    header = torch.tensor([b.code, b.step, len(b.seqs), len(out)], dtype=torch.int64)
    return header, torch.tensor(out, dtype=torch.int64)


def decode(header: torch.Tensor, payload: torch.Tensor) -> WireBatch:
    code, step, n, _ = header.tolist()
    b = WireBatch(code, step)
    v = payload.tolist()
    i = 0
    for _ in range(n):
        nt, start, nb, sample = v[i : i + 4]
        i += 4
        toks, blocks = v[i : i + nt], v[i + nt : i + nt + nb]
        i += nt + nb
        b.seqs.append(SeqChunk(toks, start, blocks, bool(sample)))
        if sample:
            b.temperatures.append(_i2f(v[i]))
            b.top_ps.append(_i2f(v[i + 1]))
            b.seeds.append(v[i + 2])
            i += 3
    if i != len(v):
        raise ValueError(f"batch payload has {len(v)} values, the chunks describe {i}")
    return b


class BatchChannel:
    """Rank 0's :meth:`send` and the other ranks' :meth:`recv` over the control group."""

    __slots__ = ("group", "rank", "registry", "timeout_s", "buf", "_idle", "_host_blocking")

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        *,
        registry: WaitRegistry,
        timeout_s: float,
        buf: list[ProbeRow] | None,
    ) -> None:
        self.group = group
        self.rank = rank
        self.registry = registry
        self.timeout_s = timeout_s
        self.buf = buf
        # The idle wait for the next round must not reach the stall watchdog: its own registry.
        self._idle = WaitRegistry()
        self._host_blocking = dist.get_backend(group) != "nccl"

    def _bcast(self, t: torch.Tensor, what: str, registry: WaitRegistry, timeout_s: float) -> None:
        work = dist.broadcast(t, src=0, group=self.group, async_op=True)
        assert work is not None
        timed_wait(
            work_ready(work, self._host_blocking), registry=registry, waiter=f"rank{self.rank}",
            what=what, signaller="rank 0" if self.rank else "every rank",
            boundary=BATCH_BROADCAST, timeout_s=timeout_s, rank=self.rank,
        )

    def send(self, b: WireBatch) -> None:
        """Rank 0: ship ``b`` to every other rank (timed, registered, one probe row)."""
        t0 = now_ns()
        header, payload = encode(b)
        what = f"batch broadcast of step {b.step}"
        self._bcast(header, what, self.registry, self.timeout_s)
        if payload.numel():
            self._bcast(payload, what, self.registry, self.timeout_s)
        if self.buf is not None and b.code == RUN:
            self.buf.append((t0, now_ns() - t0, BATCH_BROADCAST, COMM_STREAM, self.rank, b.step))

    def recv(self) -> WireBatch:
        """A worker: block until rank 0's next round (or STOP) arrives."""
        header = torch.empty(HEADER, dtype=torch.int64)
        self._bcast(header, "the next batch", self._idle, IDLE_TIMEOUT_S)
        t0 = now_ns()
        payload = torch.empty(int(header[3]), dtype=torch.int64)
        if payload.numel():
            self._bcast(payload, "batch payload", self.registry, self.timeout_s)
        b = decode(header, payload)
        if self.buf is not None and b.code == RUN:
            self.buf.append((t0, now_ns() - t0, BATCH_BROADCAST, COMM_STREAM, self.rank, b.step))
        return b
