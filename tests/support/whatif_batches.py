"""The round model's fields for overlap's rounds that launch or collect nothing, for tests
that build `Batches` by hand (viewer/analysis/whatif_model.py)."""

from __future__ import annotations

from typing import Any

import numpy as np


def drains(n: int, head_Q: Any = 0.0, tail_P: Any = 0.0, drained: Any = None) -> dict[str, np.ndarray]:
    """`drained` (none mid-run unless given; the last always), and `head_Q` (as the `head`'s
    bookkeeping) / `tail_P` (ns, scalars or per batch) where a round collects or launches nothing."""
    d = np.zeros(n, dtype=bool) if drained is None else np.array(drained, dtype=bool)
    d[-1] = True
    fresh = np.concatenate([[True], d[:-1]])
    head = np.zeros((n, 4))
    head[:, 0] = np.where(fresh, head_Q, 0.0)
    return {"drained": d, "head": head, "tail_P": np.where(d, tail_P, 0.0)}


def random_drains(data: Any, n: int) -> dict[str, np.ndarray]:
    """`drains` drawn by hypothesis: which batches drain, and 0-5 ms hand-offs and intakes."""
    from hypothesis import strategies as st

    ms = st.lists(st.floats(0, 5, allow_nan=False), min_size=n, max_size=n)
    out = drains(n, 0.0, np.array(data.draw(ms)) * 1e6, data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    fresh = np.concatenate([[True], out["drained"][:-1]])
    out["head"] = np.column_stack([np.array(data.draw(ms)) * 1e6 for _ in range(4)]) * fresh[:, None]
    return out
