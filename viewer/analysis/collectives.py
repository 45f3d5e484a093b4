"""Collectives across ranks: the straggler view and the missing rank of a stalled collective.

Both join the `collectives` table's rows of different ranks on (group, seq): the sequence number
of a group's collectives is the same on every member rank (scheduler/parallel/comm.py), which is
what NCCL's flight recorder relies on too.

* stragglers: for each collective every member issued, the rank that issued it last and by how
  much after the first (the time the earliest rank had to wait for it, at the least);
* never joined: for a collective some rank issued, the member ranks whose history stops before
  it, i.e. the ranks that never issued it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from tracing.reader import Trace
from tracing.sweep import Sweep, start_over

COLUMNS = ["rank", "group", "seq", "step", "issue_ns", "end_ns", "dur_wait_ns", "overlapped"]
READ_ROWS = 1 << 21  # collectives rows read at a time
WORST = 5


@dataclass(slots=True)
class RankLateness:
    rank: int
    last: int  # collectives this rank issued last
    share: float  # of all the collectives every member issued
    mean_ms: float  # lateness when last: its issue minus the earliest member's
    max_ms: float


@dataclass(slots=True)
class Straggler:
    group: str
    seq: int
    step: int
    rank: int  # issued last
    late_ms: float


@dataclass(slots=True)
class StragglerView:
    collectives: int  # collectives joined by every member of their group
    lateness_p50_ms: float
    lateness_p99_ms: float
    ranks: list[RankLateness] = field(default_factory=list)
    worst: list[Straggler] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _group_key(colls: pa.Table) -> tuple[np.ndarray, list[str]]:
    g = colls["group"].combine_chunks()
    if pa.types.is_dictionary(g.type):
        g = g.cast(pa.string())
    names = sorted(set(g.to_pylist()))
    idx = {n: i for i, n in enumerate(names)}
    return np.array([idx[x] for x in g.to_pylist()], dtype=np.int64), names


def straggler_view(colls: pa.Table) -> StragglerView | None:
    """None when the trace has no collective issued by more than one rank."""
    if colls.num_rows == 0:
        return None
    gk, gnames = _group_key(colls)
    seq = colls["seq"].to_numpy()
    rank = colls["rank"].to_numpy()
    issue = colls["issue_ns"].to_numpy()
    step = colls["step"].to_numpy()
    order = np.lexsort((issue, seq, gk))  # by group, seq, then issue time: the last one last
    gk, seq, rank, issue, step = gk[order], seq[order], rank[order], issue[order], step[order]
    new = np.ones(len(seq), dtype=bool)
    new[1:] = (gk[1:] != gk[:-1]) | (seq[1:] != seq[:-1])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(seq))
    # members per group: every rank that issued any collective of it
    members = {g: len(set(rank[gk == g].tolist())) for g in range(len(gnames))}
    full = (ends - starts) == np.array([members[g] for g in gk[starts]])
    full &= (ends - starts) > 1
    if not full.any():
        return None
    s, e = starts[full], ends[full]
    late_ns = issue[e - 1] - issue[s]
    last_rank = rank[e - 1]
    ranks = []
    for r in sorted(set(rank.tolist())):
        m = last_rank == r
        lat = late_ns[m] / 1e6
        ranks.append(RankLateness(int(r), int(m.sum()), float(m.mean()),
                                  float(lat.mean()) if len(lat) else 0.0,
                                  float(lat.max()) if len(lat) else 0.0))
    worst = [Straggler(gnames[gk[a]], int(seq[a]), int(step[a]), int(last_rank[i]), float(late_ns[i] / 1e6))
             for i, a in sorted(enumerate(s), key=lambda x: -late_ns[x[0]])[:WORST]]
    p50, p99 = (float(x) for x in np.percentile(late_ns / 1e6, [50, 99]))
    return StragglerView(len(s), p50, p99, ranks, worst)


def last_seqs(colls: pa.Table) -> dict[tuple[str, int], int]:
    """(group, rank) -> the last sequence number that rank issued in that group."""
    if not colls.num_rows:
        return {}
    t = colls.select(["group", "rank", "seq"])
    if pa.types.is_dictionary(t.schema.field("group").type):  # chunks' dictionaries may differ
        t = t.set_column(0, "group", t["group"].cast(pa.string()))
    t = t.group_by(["group", "rank"]).aggregate([("seq", "max")])
    d = t.to_pydict()
    return {(g, r): s for g, r, s in zip(d["group"], d["rank"], d["seq_max"], strict=True)
            if g is not None and r is not None and s is not None}


def trace_last_seqs(trace: Trace) -> dict[tuple[str, int], int]:
    """`last_seqs` of a trace's collectives, read a few row groups at a time (a long TP run
    issues millions)."""
    if not trace.has_table("collectives"):
        return {}

    def fold() -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        sw = Sweep(trace, "collectives", ["group", "rank", "seq"], time=None, dictionary=("group",))
        for t in sw.pieces(READ_ROWS):
            for k, s in last_seqs(t).items():
                out[k] = max(s, out.get(k, s))
        return out
    return start_over(trace, "collectives", fold)


def never_joined(last: dict[tuple[str, int], int], group: str, seq: int, members: list[int]) -> dict[int, int]:
    """Member ranks of ``group`` that never issued collective ``seq`` (`last`: `last_seqs`):
    {rank: its last seq (-1: none)}."""
    out = {r: last.get((group, r), -1) for r in members}
    return {r: s for r, s in out.items() if s < seq}
