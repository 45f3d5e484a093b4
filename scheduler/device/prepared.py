"""A batch as step 4 hands it to the device: prepared once on the host (the forward
batch, sampling parameters, the chunks that sample), then launched on one stream.
What the executor, the TP/PP coordinator and the engine pass between them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scheduler.core.batch import ScheduledChunk
from scheduler.device.work import Event
from scheduler.model.forward_batch import ForwardBatch, SeqChunk


@dataclass(slots=True)
class KvReadCheck:
    """Test-only: what a batch's attention will read, to verify on the device stream."""

    slots: torch.Tensor  # context slots read (positions before each chunk's start)
    positions: torch.Tensor
    tokens: torch.Tensor  # host's token at each position; < 0 = placeholder (position checked only)


@dataclass(slots=True)
class PreparedBatch:
    forward: ForwardBatch | None  # None on a device process, which builds it from `seqs`
    chunks: list[ScheduledChunk]
    sampled: list[ScheduledChunk]  # chunks that produce a token, in logits-row order
    temperatures: list[float]
    top_ps: list[float]
    seeds: list[int | None]  # each sampled row's draw seed (token_seed); None = greedy
    has_placeholders: bool
    kv_check: KvReadCheck | None = None
    seqs: list[SeqChunk] = field(default_factory=list)  # what `forward` was built from (TP/PP wire)


@dataclass(slots=True)
class Launch:
    """One prepared batch enqueued on one stream."""

    prepared: PreparedBatch
    stream: str
    step: int
    slots: list[int]  # future slot of each sampled chunk
    start: Event
    end: Event
    result: list[list[int]] = field(default_factory=list)

    def device_ns(self) -> int:
        s, e = self.start.ts_ns, self.end.ts_ns
        return 0 if s is None or e is None else e - s
