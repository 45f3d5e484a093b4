"""What changes the logits before a token is drawn (vLLM's semantics and order): `min_tokens`
and `logit_bias` first, then the repetition, frequency and presence penalties; temperature and
top-p come after, in the sampler. Raw logprobs are taken before any of it.

The host describes each batch's changes as flat lists (`LogitsAdjust`, built by the executor
from the requests, plain data so it crosses to a device process); the device applies them in
one pass over the rows that asked. A request's output history may end in placeholders (overlap
scheduling: tokens still on the device): they are resolved from the future-token ring, on the
device, as the forward's input ids are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from scheduler.model.h2d import to_device


class LogitsAdjust(NamedTuple):
    """A batch's logit changes; `row` indexes the batch's sampled rows."""

    # logit_bias: add bias_values[i] to row bias_rows[i], token bias_ids[i]
    bias_rows: list[int]
    bias_ids: list[int]
    bias_values: list[float]
    # min_tokens: these (row, token) pairs (EOS and stop_token_ids) cannot be drawn yet
    ban_rows: list[int]
    ban_ids: list[int]
    # penalties: one entry per penalised row ...
    pen_rows: list[int]
    repetition: list[float]  # 1 = none
    frequency: list[float]  # 0 = none
    presence: list[float]  # 0 = none
    # ... and its history, flat: (index into pen_rows, token id or placeholder -(slot + 1), is output)
    hist_pen: list[int]
    hist_ids: list[int]
    hist_output: list[bool]


def apply(logits: torch.Tensor, adj: LogitsAdjust, future: torch.Tensor | None) -> torch.Tensor:
    """The sampled rows' logits with `adj` applied: a copy, so the raw logits stay for logprobs."""
    out = logits.clone()
    dev = logits.device

    def t(xs: list[int]) -> torch.Tensor:
        return to_device(xs, torch.long, dev)

    def f(xs: list[float]) -> torch.Tensor:
        return to_device(xs, out.dtype, dev)

    if adj.bias_rows:
        out.index_put_((t(adj.bias_rows), t(adj.bias_ids)), f(adj.bias_values), accumulate=True)
    if adj.ban_rows:
        out[t(adj.ban_rows), t(adj.ban_ids)] = float("-inf")
    if adj.pen_rows:
        rows, vocab = t(adj.pen_rows), out.shape[1]
        ids = t(adj.hist_ids)
        if future is not None:
            ids = torch.where(ids < 0, future[(-ids - 1).clamp(min=0)], ids)
        elif adj.hist_ids and min(adj.hist_ids) < 0:
            raise ValueError("placeholder tokens in a penalty history, with no future ring to resolve them")
        n = len(adj.pen_rows)
        flat = t(adj.hist_pen) * vocab + ids
        # the output tokens' places, from the host's list: a boolean mask on the device would
        # make the host wait for it (its count sizes the result)
        outputs = [i for i, o in enumerate(adj.hist_output) if o]
        counts = torch.zeros(n * vocab, dtype=out.dtype, device=dev)
        counts.index_put_((flat.index_select(0, t(outputs)),), torch.ones(len(outputs), dtype=out.dtype, device=dev),
                          accumulate=True)
        seen = torch.zeros(n * vocab, dtype=torch.bool, device=dev)
        seen[flat] = True
        counts, seen = counts.view(n, vocab), seen.view(n, vocab)
        x = out.index_select(0, rows)
        rep = f(adj.repetition)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)  # prompt and output tokens
        x = x - f(adj.frequency)[:, None] * counts
        x = x - f(adj.presence)[:, None] * (counts > 0).to(out.dtype)
        out[rows] = x
    return out
