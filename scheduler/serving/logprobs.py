"""Log-probabilities in OpenAI's two shapes: the completions API's parallel lists
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat API's
`content` list. Tokens are named by their own text, decoded one at a time on the
sender thread (scheduler/serving/streams.py); here they are only arranged."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from scheduler.core.request import TokenLogprob

# JSON has no -inf: a probability that underflows float32 is reported as this (vLLM's floor).
FLOOR = -9999.0


class Scored(NamedTuple):
    """One position: the token's text, its logprob (None: a prompt's first token, which
    nothing predicts) and the most likely alternatives, most likely first."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...]
    width: int  # characters the token adds to the choice's text: 0 for a special token (not in it)


def scored(token_text: Callable[[int], tuple[str, bool]], token_id: int, lp: TokenLogprob | None) -> Scored:
    text, special = token_text(token_id)
    width = 0 if special else len(text)
    if lp is None:
        return Scored(text, None, (), width)
    return Scored(text, max(lp.logprob, FLOOR),
                  tuple((token_text(t)[0], max(v, FLOOR)) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)),
                  width)


def completion_logprobs(entries: Sequence[Scored], offset: int = 0) -> dict[str, Any]:
    """The completions API's object. A position's `top_logprobs` holds its own token and the
    alternatives (vLLM's: up to logprobs + 1 entries); `text_offset` is where each token's
    text starts in the choice's text, counting from `offset` (a stream's earlier text); a
    special token (BOS) adds nothing to the text, so it moves no offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        lps.append(e.logprob)
        tops.append(None if e.logprob is None else {e.token: e.logprob, **dict(e.top)})
        offsets.append(offset)
        offset += e.width
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: Sequence[Scored]) -> dict[str, Any]:
    """The chat API's object: one `content` item per token, its UTF-8 `bytes` included."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in e.top]}
                        for e in entries], "refusal": None}
