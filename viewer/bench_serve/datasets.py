"""The prompts a benchmark sends: random (vLLM's random dataset), a ShareGPT-format
JSON file, or an mstrace workload JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True, frozen=True)
class Prompt:
    text: str | list[int]  # token ids go to /v1/completions as they are
    input_len: int  # tokens, as the dataset counted them
    output_len: int


class DatasetError(ValueError):
    pass


def random_prompts(n: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int,
                   vocab: int, decode: Any, seed: int) -> list[Prompt]:
    """Lengths uniform in [len * (1 - ratio), len * (1 + ratio)]; every prompt starts with
    the same `prefix_len` random tokens; token ids drawn uniformly, then decoded to text
    (so chat works too; a server re-tokenizes, so its count can differ slightly)."""
    if not 0 <= range_ratio < 1:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]

    def length(x: int) -> int:
        return max(1, rng.randint(int(x * (1 - range_ratio)), int(x * (1 + range_ratio))))

    out = []
    for _ in range(n):
        ids = prefix + [rng.randrange(vocab) for _ in range(length(input_len))]
        out.append(Prompt(decode(ids) if decode is not None else ids, len(ids), length(output_len)))
    return out


def sharegpt_prompts(path: Path, n: int, encode: Any, output_len: int | None, seed: int) -> list[Prompt]:
    """The first human turn of each conversation; its output length is the first reply's
    length in tokens unless `output_len` is given."""
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
    out = []
    for prompt, reply in pairs[:n]:
        ids = encode(prompt)
        if not ids:
            continue
        out.append(Prompt(prompt, len(ids), output_len or max(1, len(encode(reply)))))
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
        out.append(Prompt(text, len(encode(text)) if isinstance(text, str) and encode else len(text),
                          it.params.max_new_tokens))
    if len(out) < n:
        raise DatasetError(f"{path}: {len(out)} requests, --num-prompts asks for {n}")
    return out
