"""Throughput and latency, computed the way SGLang's bench_serving does:
  duration    first arrival .. last finish
  TTFT        first token - arrival, per request
  TPOT        (e2e - TTFT) / (output_len - 1), per request with >1 output token
  ITL         every gap between consecutive output tokens of a request, all requests pooled
  E2E         finish - arrival, per request
Percentiles are linear-interpolated (numpy's default)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(slots=True)
class Dist:
    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, xs: np.ndarray) -> Dist:
        if len(xs) == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, 0)
        p50, p90, p99 = np.percentile(xs, [50, 90, 99])
        return cls(float(xs.mean()), float(p50), float(p90), float(p99), len(xs))


@dataclass(slots=True)
class Serving:
    requests: int
    completed: int
    finish_reasons: dict[str, int]
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_per_s: float
    input_tok_per_s: float
    output_tok_per_s: float
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    preemptions: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def serving_metrics(requests: pa.Table) -> Serving:
    n = requests.num_rows
    reasons: dict[str, int] = {}
    for row in pc.value_counts(requests["finish_reason"]).to_pylist() if n else []:
        reasons[row["values"]] = row["counts"]
    arrival = requests["arrival_ns"].to_numpy()
    first = requests["first_token_ns"].to_numpy()
    finish = requests["finish_ns"].to_numpy()
    out_len = requests["output_len"].to_numpy()
    in_len = requests["prompt_len"].to_numpy()
    served = first > 0
    duration = (finish.max() - arrival.min()) / 1e9 if n else 0.0  # empty after an early kill
    ttft = (first[served] - arrival[served]) / 1e6
    e2e = (finish[served] - arrival[served]) / 1e6
    multi = served & (out_len > 1)
    tpot = (finish[multi] - first[multi]) / 1e6 / (out_len[multi] - 1)
    tok = requests["token_ns"].combine_chunks() if n else pa.array([], pa.list_(pa.int64()))
    flat = pc.list_flatten(tok).to_numpy() if n else np.zeros(0, np.int64)
    parent = pc.list_parent_indices(tok).to_numpy() if n else np.zeros(0, np.int64)
    same = parent[1:] == parent[:-1]
    itl = np.diff(flat)[same] / 1e6
    out_tok = int(out_len[served].sum())
    in_tok = int(in_len[served].sum())
    return Serving(
        requests=n,
        completed=int(served.sum()),
        finish_reasons=reasons,
        duration_s=float(duration),
        input_tokens=in_tok,
        output_tokens=out_tok,
        request_per_s=float(served.sum()) / duration if duration else 0.0,
        input_tok_per_s=in_tok / duration if duration else 0.0,
        output_tok_per_s=out_tok / duration if duration else 0.0,
        ttft_ms=Dist.of(ttft),
        tpot_ms=Dist.of(tpot),
        itl_ms=Dist.of(itl),
        e2e_ms=Dist.of(e2e),
        preemptions=int(pc.sum(requests["num_preemptions"]).as_py() or 0) if n else 0,
    )
