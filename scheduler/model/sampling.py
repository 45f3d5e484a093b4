"""Token sampling: batched greedy, per-row temperature + nucleus (top-p) with per-request RNG."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from scheduler.model import native_elementwise
from scheduler.model.h2d import to_device
from scheduler.model.penalties import LogitsAdjust
from scheduler.model.penalties import apply as apply_adjust


def sample(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """`sample_on_device`, brought to the host (a sync on a GPU)."""
    return [int(t) for t in sample_on_device(logits, temperatures, top_ps, generators).tolist()]


def sample_on_device(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row of ``logits [n, V]``, as an int64 tensor on the logits' device
    (nothing here waits for the device).

    ``temperature < GREEDY_BELOW`` rows take the argmax (all such rows in one batched op).  Other rows sample
    from ``softmax(logits / T)`` restricted to the smallest top-probability set whose mass reaches
    ``top_p`` (the top token is always kept), drawing with that row's generator so a request with
    a fixed seed reproduces its tokens regardless of what it is batched with.
    """
    n = logits.shape[0]
    if not (len(temperatures) == len(top_ps) == len(generators) == n):
        raise ValueError(
            f"sample: {n} rows but {len(temperatures)} temperatures, {len(top_ps)} top_ps, "
            f"{len(generators)} generators"
        )
    greedy = [i for i, t in enumerate(temperatures) if t < GREEDY_BELOW]
    if len(greedy) == n:
        return greedy_pick(logits) if n else torch.zeros(0, dtype=torch.long, device=logits.device)
    dev = logits.device
    out = torch.zeros(n, dtype=torch.long, device=dev)
    if greedy:
        g = to_device(greedy, torch.long, dev)
        out[g] = greedy_pick(logits.index_select(0, g))
    idx = [i for i, t in enumerate(temperatures) if t >= GREEDY_BELOW]
    temps = to_device([temperatures[i] for i in idx], torch.float32, dev)
    probs = torch.softmax(logits.index_select(0, to_device(idx, torch.long, dev)).float() / temps[:, None], dim=-1)
    # Always sort (even for top_p == 1) so a seeded row draws from the same vector whatever
    # else is in the batch.
    probs, order = probs.sort(dim=-1, descending=True, stable=True)
    thr = to_device([top_ps[i] if 0.0 < top_ps[i] < 1.0 else float("inf") for i in idx], torch.float32, dev)
    # Drop a token when the mass strictly before it already reaches top_p; the top token has
    # zero mass before it, so it always survives.
    drop = probs.cumsum(dim=-1) - probs >= thr[:, None]
    drop[:, 0] = False  # (a top_p that rounds to 0 in float32 must not drop it too)
    probs = probs.masked_fill(drop, 0.0)
    # multinomial takes one generator per call, so the draw is per row; everything above is
    # batched across rows.
    for j, i in enumerate(idx):
        pick = torch.multinomial(probs[j], 1, generator=_check(generators[i], dev))
        out[i:i + 1] = order[j].gather(0, pick)
    return out


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: in one C pass on the CPU (torch's CPU argmax keeps its index one value
    at a time), the same indices; torch's elsewhere."""
    picked = native_elementwise.argmax(logits) if logits.device.type == "cpu" else None
    return logits.argmax(dim=-1) if picked is None else picked


_MASK64 = (1 << 64) - 1
# Below this a temperature is greedy (vLLM's sampling epsilon): logits / T would overflow
# float32 to inf, and softmax of inf is NaN.
GREEDY_BELOW = 1e-5


def token_seed(request_seed: int, position: int) -> int:
    """The seed of one draw: a request's seed mixed with the position of the token drawn
    (splitmix64). A token's randomness then depends on nothing but the request and where
    the token goes, not on how many draws came before: a draw whose token was thrown away
    (a preemption while its round was in flight) or redone (recompute) changes nothing,
    and every mode, device and parallel layout draws the same tokens."""
    x = (request_seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: any torch.Generator takes it


def row_generators(seeds: Sequence[int | None], device: torch.device | str) -> list[torch.Generator | None]:
    """One generator per sampled row from its draw seed (None: greedy)."""
    return [None if s is None else torch.Generator(device=device).manual_seed(s) for s in seeds]


def _check(gen: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    if gen is not None and gen.device.type != device.type:
        raise ValueError(f"generator on {gen.device} cannot sample logits on {device}")
    return gen


def sample_rows(logits: torch.Tensor, temperatures: Sequence[float], top_ps: Sequence[float],
                seeds: Sequence[int | None]) -> torch.Tensor:
    """`sample_on_device`, each row drawing with a generator made from its draw seed (None:
    greedy). What every backend runs after its forward."""
    return sample_on_device(logits, temperatures, top_ps, row_generators(seeds, logits.device))


def publish(future: torch.Tensor, slots: Sequence[int], tokens: torch.Tensor) -> None:
    """Write sampled tokens into the device's future-token ring at their slots, where the
    next round's placeholders (overlap scheduling) read them on the device."""
    future[to_device(slots, torch.long, future.device)] = tokens


@dataclass(slots=True)
class Sampled:
    """What step 4 gives back for one batch: the sampled tokens and, for the rows that asked,
    their log-probabilities. Tensors on the logits' device until `to_host`."""

    tokens: torch.Tensor  # [num_sampled] int64
    # rows: the sampled rows that asked for logprobs (in sampled order), then the scored rows
    logprob: torch.Tensor | None = None  # [m] float32: each row's own token
    top_ids: torch.Tensor | None = None  # [m, k] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [m, k] float32

    def to_host(self, non_blocking: bool = False) -> Sampled:
        """The same on the host: on a GPU into pinned memory without waiting (the launch's
        end event, which the barrier waits for, is recorded after these copies)."""
        if self.tokens.device.type != "cuda":
            return self

        def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else _pinned(t, non_blocking)

        return Sampled(_pinned(self.tokens, non_blocking), pinned(self.logprob), pinned(self.top_ids),
                       pinned(self.top_logprobs))

    def lists(self) -> SampledLists:
        """Plain lists (host tensors only): what crosses a process and what collect reads."""
        lp = None
        if self.logprob is not None and self.top_ids is not None and self.top_logprobs is not None:
            lp = (self.logprob.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist())
        return SampledLists(self.tokens.tolist(), lp)


class SampledLists(NamedTuple):
    tokens: list[int]
    # (each row's own logprob, top ids, top logprobs) per Sampled's rows; None when no row asked
    logprobs: tuple[list[float], list[list[int]], list[list[float]]] | None = None


def sample_batch(
    logits: torch.Tensor, num_sampled: int, temperatures: Sequence[float], top_ps: Sequence[float],
    seeds: Sequence[int | None], logprobs: Sequence[int], score_targets: torch.Tensor | None,
    score_k: int, adjust: LogitsAdjust | None = None, future: torch.Tensor | None = None,
) -> Sampled:
    """Step 4's sampling, the same in every backend: tokens for the first `num_sampled` rows
    of `logits` (after `adjust`'s penalties and biases, scheduler/model/penalties.py; `future`
    resolves placeholders in their histories), then, from the same raw logits and without
    leaving the device, the logprobs of the sampled rows whose `logprobs[i] >= 0` and of the
    scored rows after them (each against its `score_targets` entry). `k`: the most
    alternatives any row asked for (rows that asked fewer are cut on the host). A batch where
    no row asked for anything does no more than sample."""
    drawn = logits[:num_sampled]
    tokens = sample_rows(drawn if adjust is None else apply_adjust(drawn, adjust, future), temperatures, top_ps, seeds)
    want = [i for i, k in enumerate(logprobs) if k >= 0]  # ([] when no row asked)
    if not want and score_targets is None:
        return Sampled(tokens)
    dev = logits.device
    rows = to_device(want, torch.long, dev)
    targets = tokens.index_select(0, rows)
    k = max((logprobs[i] for i in want), default=0)
    if score_targets is not None:
        rows = torch.cat([rows, torch.arange(num_sampled, logits.shape[0], device=dev)])
        targets = torch.cat([targets, score_targets])
        k = max(k, score_k)
    lp = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    top_logprobs, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], torch.empty(lp.shape[0], 0, dtype=torch.long, device=dev))
    return Sampled(tokens, lp.gather(1, targets[:, None]).squeeze(1), top_ids, top_logprobs)


def _pinned(t: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=non_blocking)
    return host
