"""The sync-cost table of a running server, for /metrics: the trace writer's committed
batches of probes and steps, attributed by the report's own `per_cycle` as cycles complete.

A cycle runs from its round's start to the next round's start, so a batch's last
cycles are not known whole yet: the newest HOLD rounds and every row from their
start on wait for the next batch (a round's response_send row can reach the
writer a flush after its steps row). So the counters trail the run by HOLD rounds,
and once `fold(final=True)` has taken the rest they equal `report`'s table.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracing.schema import PROBES
from viewer.analysis.cycle_views import per_cycle

HOLD = 4
FOLD_ROWS = 200_000  # fold on the writer's thread too, so an unscraped server's memory stays bounded
VIEWS = (("exposed_ns:", "device"), ("host_ns:", "host"))


class LiveCost:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._probes: list[pa.Table] = []
        self._steps: list[pa.Table] = []
        self._pending = 0
        self.seconds: dict[tuple[str, str], float] = {}  # (boundary, view) -> seconds
        self.cycle_s = 0.0
        self.cycles = 0

    def on_probes(self, t: pa.Table) -> None:
        self._add(self._probes, t.select(["ts_ns", "dur_ns", "boundary", "stream"]))

    def on_steps(self, t: pa.Table) -> None:
        self._add(self._steps, t.select(["ts_ns", "dur_ns"]))

    def _add(self, into: list[pa.Table], t: pa.Table) -> None:
        with self._lock:
            into.append(t)
            self._pending += t.num_rows
            big = self._pending > FOLD_ROWS
        if big:
            self.fold()

    def fold(self, final: bool = False) -> None:
        with self._lock:
            if not self._steps:
                return
            steps = pa.concat_tables(self._steps)
            steps = steps.take(pc.sort_indices(steps["ts_ns"]))
            n = steps.num_rows
            done = n if final else n - HOLD
            if done <= 0:
                return
            probes = pa.concat_tables(self._probes).unify_dictionaries() if self._probes else None
            cut = int(steps["ts_ns"][done].as_py()) if done < n else None
            if probes is not None and cut is not None:
                early = pc.less(probes["ts_ns"], cut)
                now, later = probes.filter(early), probes.filter(pc.invert(early))
            else:
                now, later = probes, None
            # the first held round closes the last cycle taken (per_cycle's last cycle ends at its
            # round's end): its own sums are dropped
            taken = steps.slice(0, done + 1 if cut is not None else done)
            self._add_sums(now, taken, drop_last=cut is not None)
            self._steps = [steps.slice(done)] if done < n else []
            self._probes = [later] if later is not None and later.num_rows else []
            self._pending = sum(t.num_rows for t in self._steps + self._probes)

    def _add_sums(self, probes: pa.Table | None, steps: pa.Table, drop_last: bool) -> None:
        pcy = per_cycle(PROBES.empty_table() if probes is None else probes, steps)
        if not pcy:
            return
        keep = slice(0, len(pcy["cycle_ns"]) - (1 if drop_last else 0))
        self.cycles += keep.stop
        self.cycle_s += float(np.sum(pcy["cycle_ns"][keep])) / 1e9
        for key, v in pcy.items():
            for prefix, view in VIEWS:
                if key.startswith(prefix):
                    b = key[len(prefix):]
                    self.seconds[(b, view)] = self.seconds.get((b, view), 0.0) + float(np.sum(v[keep])) / 1e9

    def samples(self) -> Iterator[tuple[str, str, float]]:
        """(boundary, view, seconds) so far, after taking what is complete."""
        self.fold()
        with self._lock:
            items = sorted(self.seconds.items())
        for (b, view), s in items:
            yield b, view, s


def collector(live: LiveCost, labels: tuple[str, str]) -> Any:
    """A prometheus collector of `live`: mstrace:boundary_seconds_total{boundary, view} and
    mstrace:cost_cycle_seconds_total, the cycle time those shares are of."""
    from prometheus_client.core import CounterMetricFamily
    from prometheus_client.registry import Collector

    class _Live(Collector):
        def collect(self) -> Iterator[Any]:
            fam = CounterMetricFamily("mstrace:boundary_seconds", "The sync-cost table live: each cycle's time "
                                      "charged to a boundary, in the device or the host view (docs/report.md).",
                                      labels=["model_name", "engine", "boundary", "view"])
            for b, view, s in live.samples():
                fam.add_metric([*labels, b, view], s)
            yield fam
            cyc = CounterMetricFamily("mstrace:cost_cycle_seconds", "Cycle time attributed so far (the sum "
                                      "boundary_seconds divides by, per view).", labels=["model_name", "engine"])
            cyc.add_metric(list(labels), live.cycle_s)
            yield cyc

    return _Live()
