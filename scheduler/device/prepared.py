"""A batch as step 4 hands it to the device: prepared once on the host (the forward
batch, sampling parameters, the chunks that sample), then launched on one stream.
What the executor, the TP/PP coordinator and the engine pass between them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat

import torch

from scheduler.core.batch import ScheduledChunk
from scheduler.core.request import TokenLogprob
from scheduler.device.work import Event
from scheduler.model.forward_batch import ForwardBatch, SeqChunk
from scheduler.model.forward_step import SamplingArgs
from scheduler.model.sampling import Sampled, SampledLists


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
    sampling: SamplingArgs  # per sampled row: temperature, top-p, draw seed (token_seed), logprobs asked
    has_placeholders: bool
    kv_check: KvReadCheck | None = None
    seqs: list[SeqChunk] = field(default_factory=list)  # what `forward` was built from (TP/PP wire)

    def results(
        self, out: SampledLists, slots: list[int]
    ) -> tuple[Iterable[tuple[ScheduledChunk, int, int, TokenLogprob | None]], list[tuple[ScheduledChunk, list[TokenLogprob]]]]:
        """What step 5 reads from the device's answer: (chunk, slot, token, logprobs) per
        sampled chunk, and each scored chunk's prompt logprobs, each row cut to what its
        request asked for (the device computes the batch's largest top-k)."""
        lp = out.logprobs
        if lp is None and self.sampling.score_k < 0:  # nobody asked: the common round, kept lean
            return zip(self.sampled, slots, out.tokens, repeat(None), strict=False), []  # (lazy, as collect reads it)
        row = 0

        def entry(k: int) -> TokenLogprob:
            nonlocal row
            assert lp is not None, "the device computed no logprobs for rows that asked"
            e = TokenLogprob(lp[0][row], lp[1][row][:k], lp[2][row][:k])
            row += 1
            return e

        ks = list(self.sampling.logprobs) or [-1] * len(slots)
        sampled = [(c, slot, tok, entry(k) if k >= 0 else None)
                   for c, slot, tok, k in zip(self.sampled, slots, out.tokens, ks, strict=True)]
        scores = []
        if self.sampling.score_k >= 0:
            for c, seq in zip(self.chunks, self.seqs, strict=True):
                if seq.score_targets:
                    k = c.req.sample.sampling_params.prompt_logprobs or 0
                    scores.append((c, [entry(k) for _ in seq.score_targets]))
        return sampled, scores


@dataclass(slots=True)
class Launch:
    """One prepared batch enqueued on one stream."""

    prepared: PreparedBatch
    stream: str
    step: int
    slots: list[int]  # future slot of each sampled chunk
    start: Event
    end: Event
    # the device's answer: a Sampled from a local device, its SampledLists from a device process
    result: list[Sampled | SampledLists] = field(default_factory=list)

    def device_ns(self) -> int:
        s, e = self.start.ts_ns, self.end.ts_ns
        return 0 if s is None or e is None else e - s
