"""The cost table's invariants, checked on every trace the test suite makes
(tests/cli.py runs it after each successful `mstrace run`): each view sums to the
cycle within 2%, and no row is negative (a negative row is probes that overlap).

The sums are not true by construction: `unattributed` is what no probe claims, so a
double-counting probe shows as a negative row here, and a view that lost rows shows
as a sum off 1 only if the report's own accounting is broken."""

from __future__ import annotations

import json
from pathlib import Path

TOLERANCE = 0.02
NEGATIVE = -1e-6


def assert_views_hold(trace: Path) -> dict:
    from tests.cli import cli

    rc, out, err = cli("report", str(trace), "--json")
    assert rc == 0, err
    rep = json.loads(out)
    if not rep["probes"] or not rep["cycles"]:
        return rep
    for r in [rep, *rep.get("per_rank", {}).values()]:
        assert abs(r["share_sum"] - 1) <= TOLERANCE, (trace, "device view sums to", r["share_sum"])
        assert abs(r["host_share_sum"] - 1) <= TOLERANCE, (trace, "host view sums to", r["host_share_sum"])
        neg = {b["boundary"]: (b["share"], b["host_share"]) for b in r["boundaries"]
               if min(x for x in (b["share"], b["host_share"], 0.0) if x is not None) < NEGATIVE}
        assert not neg, (trace, "negative rows", neg)
        assert not r["negative"], (trace, r["negative"])
    return rep
