"""The scheduler's batch: which requests run this round and which tokens of each.

This is the CPU-side object (SGLang's ScheduleBatch). The executor turns it
into device tensors (scheduler.model.forward_batch.ForwardBatch); crossing that
boundary changes the type so ownership stays visible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.core.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    req: Request
    start: int  # == req.num_computed when scheduled
    num_tokens: int
    sample: bool  # the chunk ends at the request's last token: sample the next one
    # req.num_preemptions when scheduled: a result for an older generation is
    # stale (the request was preempted while this chunk was in flight).
    generation: int = 0


@dataclass(slots=True)
class ScheduleBatch:
    step: int
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decodes)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)
