"""The straggler view folded over pieces of the collectives table (viewer/analysis/collectives.py):
the same view as a plain join of the whole table, whatever the pieces, and a real TP run's
trace read a few row groups at a time gives the view of its whole table."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.kernels import c_loops
from tests.support.tiny_runs import TinyRuns
from tracing.reader import Trace
from tracing.schema import COLLECTIVES
from tracing.sweep import Group, Sweep, Vanished
from tracing.writer import parquet_options
from viewer.analysis.collectives import (
    StragglerFold,
    StragglerView,
    add_members,
    last_seqs,
    straggler_view,
    trace_members,
    trace_stragglers,
)


def members(last: dict[tuple[str, int], int]) -> dict[str, set[int]]:
    """group -> every rank that issued any collective of it, from (group, rank) keys."""
    out: dict[str, set[int]] = {}
    for g, r in last:
        out.setdefault(g, set()).add(r)
    return out


def _reference(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The view by a plain dict join: for each (group, seq) every member issued (two or more
    members), the last issuer and its lateness."""
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    ranks: dict[str, set[int]] = {}
    for r in rows:
        by.setdefault((r["group"], r["seq"]), []).append(r)
        ranks.setdefault(r["group"], set()).add(r["rank"])
    full = []
    for (g, q), rs in by.items():
        if len(rs) == len(ranks[g]) > 1:
            rs = sorted(rs, key=lambda x: (x["issue_ns"], x["rank"]))  # a tie: the higher rank is last
            full.append((rs[-1]["issue_ns"] - rs[0]["issue_ns"], g, q, rs[0]["step"], rs[-1]["rank"]))
    all_ranks = sorted(set().union(*ranks.values())) if ranks else []
    return {"n": len(full),
            "late": sorted(f[0] for f in full),
            "last": {r: sorted(f[0] for f in full if f[4] == r) for r in all_ranks},
            "worst": sorted((-f[0], f[1], f[2], f[3], f[4]) for f in full)[:5]}


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=COLLECTIVES)


@st.composite
def _collectives(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for g, nranks in enumerate(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))):
        for seq in range(draw(st.integers(0, 12))):
            t0 = seq * 1000
            for r in range(nranks):
                if draw(st.integers(0, 9)) == 0:  # this rank never issued it
                    continue
                out.append({"rank": 10 * g + r, "group": f"tp{g}", "seq": seq, "step": seq // 3 + draw(st.integers(0, 1)), "numel": 1,
                            "overlapped": False, "issue_ns": t0 + draw(st.integers(0, 30)) * 50,
                            "start_ns": t0, "end_ns": t0 + 2000, "dur_wait_ns": 0})
    return out


@pytest.mark.parametrize("c", [True, False], ids=["native", "numpy"])
@settings(max_examples=150, deadline=None)
@given(rows=_collectives(), cuts=st.lists(st.integers(0, 200), max_size=6), shuffle=st.booleans())
def test_the_fold_over_any_pieces_is_the_whole_tables_join(c: bool, rows: list[dict[str, Any]], cuts: list[int],
                                                           shuffle: bool) -> None:
    with c_loops(c):
        _fold_is_the_join(rows, cuts, shuffle)


def _fold_is_the_join(rows: list[dict[str, Any]], cuts: list[int], shuffle: bool) -> None:
    ref = _reference(rows)
    if shuffle:  # any order is right; the order of issue only keeps the carry small
        rows = [rows[i] for i in np.random.default_rng(len(rows)).permutation(len(rows))]
    else:
        rows = sorted(rows, key=lambda x: x["issue_ns"])
    t = _table(rows)
    edges = sorted({0, len(rows), *(c for c in cuts if c < len(rows))})
    pieces = [_own_dictionary(t.slice(a, b - a), k) for k, (a, b) in enumerate(zip(edges, edges[1:], strict=False))]
    seen: dict[str, set[int]] = {}
    for piece in pieces:
        add_members(piece, seen)
    assert seen == members({(r["group"], r["rank"]): 0 for r in rows})
    fold = StragglerFold(seen)
    for piece in pieces:
        fold.add(piece)
    _assert_view(fold.view(), ref)
    _assert_view(straggler_view(t), ref)
    # what still waits for a member's row: the rows of the collectives some member never issued
    issued: dict[tuple[str, int], int] = {}
    for r in rows:
        issued[r["group"], r["seq"]] = issued.get((r["group"], r["seq"]), 0) + 1
    assert len(fold.carry[0]) == sum(1 for r in rows if issued[r["group"], r["seq"]] < len(seen[r["group"]]))


def _own_dictionary(t: pa.Table, k: int) -> pa.Table:
    """`t` with its group column in a dictionary of its own (as each part's read has): the
    groups in another order for every other piece, and a name no row uses."""
    names = sorted(set(t["group"].to_pylist()) | {f"unused{k}"}, reverse=bool(k % 2))
    idx = pa.array([names.index(g) for g in t["group"].to_pylist()], pa.int32())
    return t.set_column(t.schema.get_field_index("group"), "group", pa.DictionaryArray.from_arrays(idx, names))


def _assert_view(sv: StragglerView | None, ref: dict[str, Any]) -> None:
    if not ref["n"]:
        assert sv is None
        return
    assert sv is not None and sv.collectives == ref["n"]
    late_ms = np.array(ref["late"]) / 1e6
    assert (sv.lateness_p50_ms, sv.lateness_p99_ms) == tuple(float(x) for x in np.percentile(late_ms, [50, 99]))
    assert [x.rank for x in sv.ranks] == sorted(ref["last"])
    for x in sv.ranks:
        mine = ref["last"][x.rank]
        assert x.last == len(mine) and x.share == len(mine) / ref["n"]
        assert x.mean_ms == pytest.approx(np.mean(mine) / 1e6 if mine else 0.0, abs=1e-12)
        assert x.max_ms == (max(mine) / 1e6 if mine else 0.0)
    assert [(-round(w.late_ms * 1e6), w.group, w.seq, w.step, w.rank) for w in sv.worst] == ref["worst"]


@pytest.fixture
def tp2_in_fives(tiny_runs: TinyRuns, tmp_path: Path) -> Path:
    """A real TP2 run's trace, its collectives (two ranks' parts) rewritten in row groups of 5."""
    dst = tmp_path / "tp2"
    shutil.copytree(tiny_runs("--tp", "2", "--requests", "12", "-q").out, dst)
    for part in (dst / "collectives").glob("*.parquet"):
        t = pq.read_table(part)
        pq.write_table(t, part, row_group_size=5, **parquet_options(t.schema))
    return dst


def test_a_tp_trace_read_in_row_groups_gives_its_whole_tables_view(tp2_in_fives: Path) -> None:
    """Read a row group at a time, in order of issue: the whole table's view, and the plain join's."""
    tr = Trace.open(tp2_in_fives)
    whole = tr.table("collectives")
    want = straggler_view(whole)
    assert want is not None and want.collectives > 10
    _assert_view(want, _reference(whole.to_pylist()))
    assert trace_members(tr) == members(last_seqs(whole)) == {"tp0": {0, 1}}
    rows, got = trace_stragglers(tr, piece_rows=5)
    assert rows == whole.num_rows and got == want


def test_a_part_gone_mid_read_starts_the_join_over(tp2_in_fives: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live compaction can replace a part under a read (tracing/sweep.py): the join starts over
    on a fresh snapshot, with nothing kept of the first try."""
    tr = Trace.open(tp2_in_fives)
    want = straggler_view(tr.table("collectives"))
    reads, read = [0], Sweep._read

    def vanishing(self: Sweep, groups: list[Group]) -> pa.Table:
        if "seq" in self.columns:  # the join's pass (the members' few reads go through `stored`)
            reads[0] += 1
            if reads[0] == 4:  # after it has folded some pieces
                raise Vanished(groups[0].part.path.name)
        return read(self, groups)
    monkeypatch.setattr(Sweep, "_read", vanishing)
    rows, got = trace_stragglers(tr, piece_rows=5)
    assert reads[0] > 4 and got == want and rows == tr.table("collectives").num_rows


def test_the_members_come_from_statistics_and_the_groups_they_cannot_settle(tp2_in_fives: Path) -> None:
    """Row groups that mix ranks, as a compacted trace's do, and one that mixes groups: the
    members are every (group, rank) pair in the table. The second row group spans ranks
    0-6 with 4 in its middle and 5 nowhere; the third holds two groups' rows."""
    part = sorted((tp2_in_fives / "collectives").glob("*.parquet"))[0]
    t = pq.read_table(part)
    assert t.num_rows > 15
    group, rank = t["group"].to_pylist(), t["rank"].to_numpy().copy()
    rank[5:10] = [0, 4, 6, 6, 6]
    group[10:15] = ["tp0", "pp9", "pp9", "tp0", "tp0"]
    rank[10:15] = [0, 7, 9, 0, 0]
    t = t.set_column(t.schema.get_field_index("rank"), "rank", pa.array(rank, t.schema.field("rank").type))
    t = t.set_column(t.schema.get_field_index("group"), "group", pa.array(group, t.schema.field("group").type))
    pq.write_table(t, part, row_group_size=5, **parquet_options(t.schema))
    trace = Trace.open(tp2_in_fives)
    whole = trace.table("collectives", ["group", "rank"]).to_pydict()
    want: dict[str, set[int]] = {}
    for g, r in zip(whole["group"], whole["rank"], strict=True):
        want.setdefault(g, set()).add(r)
    assert 4 in want["tp0"] and 5 not in want["tp0"] and want["pp9"] == {7, 9}
    assert trace_members(trace) == want
