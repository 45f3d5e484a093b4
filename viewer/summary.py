"""Run summary: throughput and latency percentiles from a trace's requests table.

Pure functions from Arrow tables to plain records, so they can be called from
Python or the CLI alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


@dataclass(slots=True)
class Latency:
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, xs: list[float]) -> Latency:
        mean = sum(xs) / len(xs) if xs else float("nan")
        return cls(percentile(xs, 50), percentile(xs, 90), percentile(xs, 99), mean)


@dataclass(slots=True)
class RunSummary:
    requests: int
    finish_reasons: dict[str, int]
    prompt_tokens: int
    output_tokens: int
    cached_prefix_tokens: int
    preemptions: int
    wall_s: float
    output_tok_per_s: float
    total_tok_per_s: float
    ttft_ms: Latency
    tpot_ms: Latency
    e2e_ms: Latency

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_requests(requests: pa.Table) -> RunSummary:
    r = requests.to_pydict()
    n = requests.num_rows
    reasons: dict[str, int] = {}
    for fr in r["finish_reason"]:
        reasons[fr] = reasons.get(fr, 0) + 1
    served = [i for i in range(n) if r["first_token_ns"][i]]
    ttft = [(r["first_token_ns"][i] - r["arrival_ns"][i]) / 1e6 for i in served]
    e2e = [(r["finish_ns"][i] - r["arrival_ns"][i]) / 1e6 for i in served]
    tpot = [
        (r["finish_ns"][i] - r["first_token_ns"][i]) / 1e6 / (r["output_len"][i] - 1)
        for i in served
        if r["output_len"][i] > 1
    ]
    out_tok = int(pc.sum(requests["output_len"]).as_py() or 0) if n else 0
    in_tok = int(pc.sum(requests["prompt_len"]).as_py() or 0) if n else 0
    if n:
        start = min(r["arrival_ns"])
        end = max(r["finish_ns"])
        wall = max(end - start, 1) / 1e9
    else:
        wall = 0.0
    return RunSummary(
        requests=n,
        finish_reasons=reasons,
        prompt_tokens=in_tok,
        output_tokens=out_tok,
        cached_prefix_tokens=int(pc.sum(requests["cached_prefix_len"]).as_py() or 0) if n else 0,
        preemptions=int(pc.sum(requests["num_preemptions"]).as_py() or 0) if n else 0,
        wall_s=wall,
        output_tok_per_s=out_tok / wall if wall else 0.0,
        total_tok_per_s=(out_tok + in_tok) / wall if wall else 0.0,
        ttft_ms=Latency.of(ttft),
        tpot_ms=Latency.of(tpot),
        e2e_ms=Latency.of(e2e),
    )
