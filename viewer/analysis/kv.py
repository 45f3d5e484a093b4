"""KV usage: peak and mean block occupancy, and the prefix-sharing hit rate."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


@dataclass(slots=True)
class KvUsage:
    num_blocks: int
    peak_blocks: int
    peak_occupancy: float
    mean_occupancy: float
    prompt_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float  # prompt tokens served from shared blocks / all prompt tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kv_usage(steps: pa.Table, requests: pa.Table, num_blocks: int) -> KvUsage:
    used = steps["blocks_used"]
    peak = int(pc.max(used).as_py() or 0) if steps.num_rows else 0
    mean = float(pc.mean(used).as_py() or 0.0) if steps.num_rows else 0.0
    prompt = int(pc.sum(requests["prompt_len"]).as_py() or 0) if requests.num_rows else 0
    hit = int(pc.sum(requests["cached_prefix_len"]).as_py() or 0) if requests.num_rows else 0
    return KvUsage(
        num_blocks=num_blocks,
        peak_blocks=peak,
        peak_occupancy=peak / num_blocks if num_blocks else 0.0,
        mean_occupancy=mean / num_blocks if num_blocks else 0.0,
        prompt_tokens=prompt,
        prefix_hit_tokens=hit,
        prefix_hit_rate=hit / prompt if prompt else 0.0,
    )
