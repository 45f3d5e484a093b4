"""The prompts a benchmark sends: random (vLLM's random dataset), a ShareGPT-format
JSON file, or an mstrace workload JSONL file."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True, frozen=True)
class Prompt:
    text: str | list[int]  # token ids go to /v1/completions as they are
    input_len: int  # tokens, as the dataset counted them
    output_len: int
    # a workload item's own request fields (its sampling, ignore_eos, add_special_tokens)
    # and arrival, which the request carries and the schedule keeps
    body: dict[str, object] = field(default_factory=dict)
    arrival_s: float = 0.0


class DatasetError(ValueError):
    pass


# Rounds of decode -> re-encode -> trim or extend before a prompt that still misses its
# length is settled for the nearest count in range (or refused): on the tokenizers tried,
# byte-level BPE among them, a prompt lands on its count in a few.
FIT_ROUNDS = 64


def random_prompts(n: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int, vocab: int,
                   encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                   seed: int) -> list[Prompt]:
    """Text prompts of `prefix_len` + L tokens as `encode` counts them, L uniform in
    [input_len * (1 - ratio), input_len * (1 + ratio)]; every prompt starts with the same
    prefix text. `encode` must count as the server does (tokens it adds, such as a BOS,
    included). Random ids decoded to text re-encode to other ids, often more of them
    (a piece of a UTF-8 character decodes to U+FFFD, which is three bytes' worth), so
    each prompt is decoded, counted, and trimmed or extended until the count is its own."""
    if not 0 <= range_ratio < 1:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    pool = _round_trip_ids(vocab, encode, decode)

    def draw(k: int) -> list[int]:
        return [pool[rng.randrange(len(pool))] for _ in range(k)]

    prefix = _fit("", prefix_len, prefix_len, prefix_len, draw, encode, decode) if prefix_len else ""
    in_lo, in_hi = _bounds(input_len, range_ratio)
    out_lo, out_hi = _bounds(output_len, range_ratio)
    out = []
    for _ in range(n):
        want = rng.randint(in_lo, in_hi)
        text = _fit(prefix, prefix_len + want, prefix_len + in_lo, prefix_len + in_hi, draw, encode, decode)
        out.append(Prompt(text, len(encode(text)), rng.randint(out_lo, out_hi)))
    return out


def _bounds(x: int, ratio: float) -> tuple[int, int]:
    """[x * (1 - ratio), x * (1 + ratio)] in whole tokens inside it, at least 1 (the slack
    keeps 100 * 0.9 = 90.00000000000001 from rounding up to 91)."""
    slack = 1e-9 * max(1, x)
    return max(1, math.ceil(x * (1 - ratio) - slack)), max(1, math.floor(x * (1 + ratio) + slack))


def _round_trip_ids(vocab: int, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> list[int]:
    """The ids whose own text encodes back to them alone: no special token (it decodes to
    nothing), no piece of a character. Prompts made of them land on their count sooner."""
    around = len(encode(""))  # what the tokenizer puts around any text (a BOS)
    pool = []
    for i in range(vocab):
        try:
            text = decode([i])
        except Exception:  # noqa: BLE001 - an id past the tokenizer's vocabulary (a padded embedding)
            continue
        if text:
            ids = encode(text)
            if len(ids) == around + 1 and i in ids:
                pool.append(i)
    if not pool:
        raise DatasetError("random: no token of this tokenizer encodes back to itself; give a dataset file")
    return pool


def _fit(head: str, want: int, lo: int, hi: int, draw: Callable[[int], list[int]],
         encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> str:
    """`head` and random text after it that `encode` counts as `want` tokens in all; after
    FIT_ROUNDS rounds without that count, the text whose count in [lo, hi] was nearest."""
    ids = draw(max(0, want - len(encode(head))))
    best: tuple[int, str] | None = None
    for _ in range(FIT_ROUNDS):
        text = head + decode(ids)
        got = len(encode(text))
        if got == want:
            return text
        if lo <= got <= hi and (best is None or abs(got - want) < abs(best[0] - want)):
            best = (got, text)
        # the fresh draws on extending are what keep a merge at the seam from cycling
        ids = ids[:max(0, len(ids) - (got - want))] if got > want else ids + draw(want - got)
    if best is None:
        raise DatasetError(f"random: no prompt of {lo}-{hi} tokens from this tokenizer in {FIT_ROUNDS} rounds")
    return best[1]


# vLLM's ShareGPT filter (benchmarks' is_valid_sequence): a prompt or a reply shorter than
# this, a prompt longer than that, or the two together longer, is skipped
SHAREGPT_MIN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


def sharegpt_prompts(path: Path, n: int, encode: Any, output_len: int | None, seed: int) -> list[Prompt]:
    """The first human turn of each conversation, as `vllm bench serve` samples them: the
    conversations shuffled, then taken in that order while they pass vLLM's filter, until
    `n`; its output length is the first reply's length in tokens unless `output_len` is given
    (then the reply's own length is not filtered)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not a readable JSON file: {e}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for i, conv in enumerate(data):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            raise DatasetError(f"{path}: conversation {i} has a turn without a string 'value'")
        pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pairs)
    out: list[Prompt] = []
    for prompt, reply in pairs:
        if len(out) == n:
            break
        p_len = len(encode(prompt))
        o_len = output_len or len(encode(reply))
        if (p_len < SHAREGPT_MIN or (output_len is None and o_len < SHAREGPT_MIN) or p_len > SHAREGPT_MAX_PROMPT
                or p_len + o_len > SHAREGPT_MAX_TOTAL):
            continue
        out.append(Prompt(prompt, p_len, o_len))
    if len(out) < n:
        raise DatasetError(f"{path}: {len(out)} usable conversations, --num-prompts asks for {n}")
    return out


def workload_prompts(path: Path, n: int, encode: Any) -> list[Prompt]:
    """An mstrace workload JSONL file (scheduler/harness/workload.py's format)."""
    from scheduler.harness.workload import WorkloadError, load_workload

    try:
        items = load_workload(path)
    except WorkloadError as e:
        raise DatasetError(str(e)) from None
    out = []
    for it in items[:n]:
        text: str | list[int] = it.prompt if it.prompt is not None else list(it.input_ids or ())
        sp = it.params
        body: dict[str, object] = {"temperature": sp.temperature, "top_p": sp.top_p}
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.ignore_eos:
            body["ignore_eos"] = True
        if isinstance(text, str) and not it.add_special_tokens:
            body["add_special_tokens"] = False  # vLLM's field: the text's own tokens, no BOS
        n_in = len(encode(text, add_special_tokens=it.add_special_tokens)) if isinstance(text, str) else len(text)
        out.append(Prompt(text, n_in, sp.max_new_tokens, body, it.arrival_s))
    if len(out) < n:
        raise DatasetError(f"{path}: {len(out)} requests, --num-prompts asks for {n}")
    return out
