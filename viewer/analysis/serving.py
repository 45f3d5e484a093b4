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
    def of(cls, xs: np.ndarray, scale: float = 1.0) -> Dist:
        """Exact linear-interpolated percentiles; partitions `xs` in place (no copy)."""
        n = len(xs)
        if n == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, 0)
        pos = [(n - 1) * q / 100 for q in (50, 90, 99)]
        kth = sorted({int(p) for p in pos} | {min(int(p) + 1, n - 1) for p in pos})
        xs.partition(kth)
        vals = []
        for p in pos:
            lo, hi = int(p), min(int(p) + 1, n - 1)
            vals.append((float(xs[lo]) + (float(xs[hi]) - float(xs[lo])) * (p - lo)) * scale)
        return cls(float(xs.mean()) * scale, vals[0], vals[1], vals[2], n)


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
    itl = _inter_token_ns(requests["token_ns"])
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
        itl_ms=Dist.of(itl, 1e-6),
        e2e_ms=Dist.of(e2e),
        preemptions=int(pc.sum(requests["num_preemptions"]).as_py() or 0) if n else 0,
    )


def _inter_token_ns(col: pa.ChunkedArray) -> np.ndarray:
    """Gaps between consecutive tokens of each request, pooled, as int64 ns.

    Works chunk by chunk on the list offsets (no parent-index array), because
    a long trace holds tens of millions of token timestamps.
    """
    parts = []
    for chunk in col.chunks:
        offsets = chunk.offsets.to_numpy()
        if len(offsets) < 2:
            continue
        flat = chunk.values.to_numpy()[offsets[0] : offsets[-1]]
        if len(flat) < 2:
            continue
        d = np.diff(flat)
        # drop the gap from one request's last token to the next request's first
        cut = offsets[1:-1] - offsets[0] - 1
        cut = cut[(cut >= 0) & (cut < len(d))]
        keep = np.ones(len(d), dtype=bool)
        keep[cut] = False
        parts.append(d[keep])
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
