"""The cost table's invariants, checked on every trace the test suite makes
(tests/support/cli.py runs it after each successful `mstrace run`): each view sums to the
cycle within 2%, no row is negative (a negative row is probes that overlap), no row's
ms per cycle in either view exceeds the cycle, and `--json`'s per-view ms per cycle and
shares are exactly what the text table prints, rank by rank.

The sums are not true by construction: `unattributed` is what no probe claims, so a
double-counting probe shows as a negative row here, and a view that lost rows shows
as a sum off 1 only if the report's own accounting is broken."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

TOLERANCE = 0.02
NEGATIVE = -1e-6
VIEWS = ("device_ms_per_cycle", "device_share", "host_ms_per_cycle", "host_share")


def assert_views_hold(trace: Path) -> dict:
    from tests.support.cli import cli

    rc, out, err = cli("report", str(trace), "--json")
    assert rc == 0, err
    rep = json.loads(out)
    if not rep["probes"] or not rep["cycles"]:
        return rep
    for r in [rep, *rep.get("per_rank", {}).values()]:
        assert abs(r["device_share_sum"] - 1) <= TOLERANCE, (trace, "device view sums to", r["device_share_sum"])
        if r["host_share_sum"] is not None:  # (null: a rank without a scheduling thread)
            assert abs(r["host_share_sum"] - 1) <= TOLERANCE, (trace, "host view sums to", r["host_share_sum"])
        neg = {b["boundary"]: (b["device_share"], b["host_share"]) for b in r["boundaries"]
               if min(x for x in (b["device_share"], b["host_share"], 0.0) if x is not None) < NEGATIVE}
        assert not neg, (trace, "negative rows", neg)
        assert not r["negative"], (trace, r["negative"])
        cyc = r["cycle_ms"]
        for b in r["boundaries"]:
            for view in ("device", "host"):
                ms, share = b[f"{view}_ms_per_cycle"], b[f"{view}_share"]
                assert (ms is None) == (share is None), (trace, b)
                assert ms is None or (ms == share * cyc and ms <= cyc * (1 + TOLERANCE)), (trace, view, b, cyc)
    rc, text, err = cli("report", str(trace))
    assert rc == 0, err
    # the order `report` prints them in; rank 0's per-rank table is the top one, not printed twice
    tables = [rep, *(c for r, c in rep.get("per_rank", {}).items() if r != "0")]
    want = [row for r in tables for row in json_rows(r)]
    got = table_rows(text, {b["boundary"] for r in tables for b in r["boundaries"]})
    assert len(got) == len(want) and all(g[: len(w)] == w for g, w in zip(got, want, strict=True)), \
        (trace, "the text table and --json differ", got, want)
    if "0" in rep.get("per_rank", {}):
        assert json_rows(rep["per_rank"]["0"]) == json_rows(rep), (trace, "rank 0's table is not the top one")
    return rep


def json_rows(r: dict[str, Any]) -> list[tuple[str, ...]]:
    """Each row's name and per-view numbers from --json, rounded as the text table rounds them
    (the device's only where the table has no host view)."""
    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    def pct(x: float | None) -> str:
        return "—" if x is None else f"{100 * x:.1f}%"

    host = r["host_share_sum"] is not None  # a table without a host view prints no host columns
    return [(b["boundary"], ms(b["device_ms_per_cycle"]), pct(b["device_share"]),
             *((ms(b["host_ms_per_cycle"]), pct(b["host_share"])) if host else ())) for b in r["boundaries"]]


def table_rows(text: str, names: set[str]) -> list[tuple[str, ...]]:
    """The same five cells of every cost-table row, in order, read back from `report`'s text."""
    return [tuple(cells[:5]) for line in text.splitlines()
            if len(cells := line.split()) >= 3 and cells[0] in names and re.fullmatch(r"[\d.]+|—", cells[1])]
