"""Workloads: the JSONL contract other tools depend on, and a synthetic generator.

One JSON object per line:
  id (str, optional), prompt (str) | input_ids (list[int]), max_new_tokens (int),
  temperature (float, default 0 = greedy), top_p (default 1), seed (int, optional),
  ignore_eos (bool, default false), arrival_s (float, default 0),
  add_special_tokens (bool, default true; a `prompt` gets the tokenizer's BOS unless false),
  logprobs, prompt_logprobs (int 0-20, optional: computed as `serve` computes them, so their
  cost is in the run's trace; `run` does not store the values).
The whole file is validated before anything runs; an error names the line and field.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from scheduler.core.request import MAX_LOGPROBS, SamplingParams
from tracing.run_status import first_line

MAX_ARRIVAL_S = 1e8  # three years: an arrival's ns stay far inside int64
FIELDS = {"id", "prompt", "input_ids", "max_new_tokens", "temperature", "top_p", "seed", "ignore_eos", "arrival_s",
          "add_special_tokens", "logprobs", "prompt_logprobs"}


class WorkloadError(ValueError):
    """A bad workload; the message is one line naming the line number and the field."""


@dataclass(slots=True, frozen=True)
class WorkloadItem:
    request_id: str
    prompt: str | None
    input_ids: tuple[int, ...] | None
    params: SamplingParams
    arrival_s: float = 0.0
    # a `prompt` is encoded with the special tokens the folder's tokenizer adds (its BOS),
    # as transformers and vLLM's completions do; false: the text's own tokens only
    add_special_tokens: bool = True

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.request_id}
        if self.prompt is not None:
            d["prompt"] = self.prompt
            if not self.add_special_tokens:
                d["add_special_tokens"] = False
        else:
            d["input_ids"] = list(self.input_ids or ())
        p = self.params
        d.update(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                 ignore_eos=p.ignore_eos, arrival_s=self.arrival_s)
        for name in ("seed", "logprobs", "prompt_logprobs"):
            if getattr(p, name) is not None:
                d[name] = getattr(p, name)
        return d


def _field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    if name not in obj:
        return default
    v = obj[name]
    # bool is an int subclass in Python; a JSON `true` is never a valid count.
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise WorkloadError(f"{where}: field '{name}' must be {_kind_name(kind)}, got {json.dumps(v)}")
    if not isinstance(v, kind):
        raise WorkloadError(f"{where}: field '{name}' must be {_kind_name(kind)}, got {json.dumps(v)[:40]}")
    # Python's json reads NaN and Infinity; no field of a request means anything with them
    if isinstance(v, float) and not math.isfinite(v):
        raise WorkloadError(f"{where}: field '{name}' must be a finite number, got {json.dumps(v)}")
    return v


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}
    ks = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in ks if not (k is int and float in ks))


def parse_item(obj: Any, index: int, where: str, vocab_size: int | None = None) -> WorkloadItem:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - FIELDS
    if unknown:
        raise WorkloadError(f"{where}: unknown field '{sorted(unknown)[0]}' (known: {', '.join(sorted(FIELDS))})")
    rid = _field(obj, "id", str, f"req-{index}", where)
    prompt = _field(obj, "prompt", str, None, where)
    ids = _field(obj, "input_ids", list, None, where)
    if (prompt is None) == (ids is None):
        raise WorkloadError(f"{where}: field 'prompt' or 'input_ids': give exactly one of them")
    if prompt is not None and not prompt:
        raise WorkloadError(f"{where}: field 'prompt' is empty")
    if ids is not None:
        if not ids:
            raise WorkloadError(f"{where}: field 'input_ids' is empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise WorkloadError(f"{where}: field 'input_ids' must hold non-negative integers, got {json.dumps(t)}")
            if vocab_size is not None and t >= vocab_size:
                raise WorkloadError(f"{where}: field 'input_ids' has token {t}, outside the model's vocabulary of {vocab_size}")
    if "max_new_tokens" not in obj:
        raise WorkloadError(f"{where}: field 'max_new_tokens' is required")
    max_new = _field(obj, "max_new_tokens", int, 0, where)
    if max_new < 1:
        raise WorkloadError(f"{where}: field 'max_new_tokens' must be >= 1, got {max_new}")
    temperature = float(_field(obj, "temperature", (int, float), 0.0, where))
    if temperature < 0:
        raise WorkloadError(f"{where}: field 'temperature' must be >= 0, got {temperature}")
    top_p = float(_field(obj, "top_p", (int, float), 1.0, where))
    if not 0 < top_p <= 1:
        raise WorkloadError(f"{where}: field 'top_p' must be in (0, 1], got {top_p}")
    seed = _field(obj, "seed", int, None, where)
    ignore_eos = _field(obj, "ignore_eos", bool, False, where)
    add_special = _field(obj, "add_special_tokens", bool, True, where)
    if ids is not None and "add_special_tokens" in obj:
        raise WorkloadError(f"{where}: field 'add_special_tokens' applies to a 'prompt', not to 'input_ids'")
    arrival = float(_field(obj, "arrival_s", (int, float), 0.0, where))
    if not 0 <= arrival <= MAX_ARRIVAL_S:  # (a NaN fails it too) past it: no int64 ns clock holds the moment
        raise WorkloadError(f"{where}: field 'arrival_s' must be between 0 and {MAX_ARRIVAL_S:g} s, got {arrival}")
    lps = {}
    for name in ("logprobs", "prompt_logprobs"):
        k = lps[name] = _field(obj, name, int, None, where)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise WorkloadError(f"{where}: field '{name}' must be between 0 and {MAX_LOGPROBS}, got {k}")
    params = SamplingParams(max_new, temperature, top_p, seed, ignore_eos, **lps)
    return WorkloadItem(rid, prompt, tuple(ids) if ids is not None else None, params, arrival, add_special)


def load_workload(path: str | Path, vocab_size: int | None = None) -> list[WorkloadItem]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # a BOM (Windows editors write one) is not the first line's
    except FileNotFoundError:
        raise WorkloadError(f"workload file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"cannot read workload {p}: {e}") from None
    items: list[WorkloadItem] = []
    seen: set[str] = set()
    # JSON Lines end lines with \n (or \r\n) only: splitlines() also cut at U+2028, U+2029 and
    # U+0085, which json.dumps(ensure_ascii=False) leaves unescaped inside a prompt
    for lineno, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        where = f"{p.name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except (ValueError, RecursionError) as e:  # an integer past Python's digit limit, nesting too deep
            raise WorkloadError(f"{where}: not valid JSON ({first_line(e)[:120]})") from None
        item = parse_item(obj, len(items), where, vocab_size)
        if item.request_id in seen and isinstance(obj, dict) and "id" not in obj:
            # a line without an id whose default (req-N) another line took by name: another
            # default, not a "duplicate" refused on a line that names none
            k = next(k for k in itertools.count(2) if f"{item.request_id}-{k}" not in seen)
            item = replace(item, request_id=f"{item.request_id}-{k}")
        if item.request_id in seen:
            raise WorkloadError(f"{where}: field 'id': duplicate request id {item.request_id!r}")
        seen.add(item.request_id)
        items.append(item)
    if not items:
        raise WorkloadError(f"{p}: the workload is empty")
    return items


@dataclass(slots=True, frozen=True)
class SyntheticSpec:
    requests: int = 64
    prompt_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (32, 128)
    shared_prefix_frac: float = 0.25  # fraction of requests that start with one common system prompt
    shared_prefix_len: int = 64
    rate: float = 0.0  # requests/s, Poisson arrivals; 0 = everything at time 0
    ignore_eos: bool = True  # random weights hit EOS at random; fixed lengths make runs comparable
    seed: int = 0

    def check(self) -> None:
        """WorkloadError with the first flag out of range (said before a model is loaded for it)."""
        if self.requests < 1:
            raise WorkloadError("--requests must be >= 1")
        for name, (lo, hi) in (("prompt", self.prompt_len), ("output", self.output_len)):
            if lo < 1 or hi < lo:
                raise WorkloadError(f"--{name}-len range must satisfy 1 <= min <= max, got {lo}-{hi}")
        if not 0 <= self.shared_prefix_frac <= 1:
            raise WorkloadError("--shared-prefix must be in [0, 1]")
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise WorkloadError(f"--rate must be a finite number of requests/s >= 0 (0: all at t=0), got {self.rate}")
        if self.rate and self.requests / self.rate > MAX_ARRIVAL_S / 100:  # the last arrival, with room to spare
            raise WorkloadError(f"--rate {self.rate:g}: {self.requests} requests would arrive over "
                                f"{self.requests / self.rate:.3g} s; give a rate of at least "
                                f"{100 * self.requests / MAX_ARRIVAL_S:.3g} requests/s")


def synthetic_workload(spec: SyntheticSpec, vocab_size: int, special_ids: set[int]) -> list[WorkloadItem]:
    """Random-token prompts with exact lengths, drawn from a seeded RNG."""
    spec.check()
    rng = random.Random(spec.seed)
    vocab = [t for t in range(vocab_size) if t not in special_ids]
    prefix = [rng.choice(vocab) for _ in range(spec.shared_prefix_len)]
    t = 0.0
    items = []
    for i in range(spec.requests):
        n = rng.randint(*spec.prompt_len)
        body = [rng.choice(vocab) for _ in range(n)]
        if rng.random() < spec.shared_prefix_frac and n > spec.shared_prefix_len:
            body[: spec.shared_prefix_len] = prefix
        if spec.rate > 0:
            t += rng.expovariate(spec.rate)
        params = SamplingParams(rng.randint(*spec.output_len), ignore_eos=spec.ignore_eos)
        items.append(WorkloadItem(f"req-{i}", None, tuple(body), params, round(t, 6)))
    return items


def workload_digest(items: list[WorkloadItem]) -> str:
    """sha256 of the canonical JSONL form: equal digests mean the same workload."""
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps(it.to_json(), sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def save_workload(items: list[WorkloadItem], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(it.to_json()) + "\n")
