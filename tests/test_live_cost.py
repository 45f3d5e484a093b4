"""serve's live cost table: batches of a real trace, as the writer commits them, add up to
the report's table once the last ones are taken."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from tests.support.tiny_runs import TinyRuns
from tracing.reader import Trace
from viewer.analysis.cycle_views import per_cycle
from viewer.commands.live_cost import HOLD, LiveCost


@pytest.fixture(scope="module")
def trace(tiny_runs: TinyRuns) -> Path:
    return tiny_runs("--requests", "24", "--rate", "40", "-q").out


def _batches(t: pa.Table, cuts: list[int]) -> list[pa.Table]:
    t = t.take(pc.sort_indices(t["ts_ns"]))
    ts = t["ts_ns"].to_numpy()
    edges = [0, *np.searchsorted(ts, cuts).tolist(), t.num_rows]
    return [t.slice(a, b - a) for a, b in zip(edges, edges[1:], strict=False)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batches_add_up_to_the_reports_table(trace: Path, seed: int) -> None:
    tr = Trace.open(trace)
    probes, steps = tr.table("probes"), tr.table("steps")
    s = np.sort(steps["ts_ns"].to_numpy())
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(int(s[0]), int(s[-1])), 12))
    live = LiveCost()
    pb, sb = _batches(probes, cuts), _batches(steps, cuts)
    for k, (p_, s_) in enumerate(zip(pb, sb, strict=True)):
        if k % 2:  # the writer may commit a round's probes a flush after its steps row
            live.on_steps(s_)
            live.on_probes(p_)
        else:
            live.on_probes(p_)
            live.on_steps(s_)
        live.fold()
    assert live.cycles <= len(s) - HOLD or live.cycles == 0
    live.fold(final=True)
    want = per_cycle(probes, steps, totals=True)
    assert live.cycles == len(s)
    assert live.cycle_s == pytest.approx(float(want["cycle_ns"][0]) / 1e9, rel=1e-9)
    for key, v in want.items():
        for prefix, view in (("exposed_ns:", "device"), ("host_ns:", "host")):
            if key.startswith(prefix):
                got = live.seconds.get((key[len(prefix):], view), 0.0)
                assert got == pytest.approx(float(v[0]) / 1e9, rel=1e-9, abs=1e-12), (key, view)
