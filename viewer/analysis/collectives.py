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

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from tracing.reader import Trace
from tracing.sweep import Group, Sweep, start_over
from viewer.analysis import native

READ_ROWS = 1 << 21  # collectives rows read at a time
SEQ_BITS = 40  # a group's collectives numbered below 2^40: (group, seq) in one int64
SEQ_MASK = (1 << SEQ_BITS) - 1
WORST = 5
MAX_RANK_SPAN = 1 << 12  # ranks a row group's statistics may span before its column is read instead


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


FOLD_COLUMNS = ("group", "seq", "rank", "issue_ns", "step")  # what `StragglerFold.add` reads


class StragglerFold:
    """`straggler_view` over a table read in pieces, given each group's member ranks: a
    collective is counted once all its members' rows have come; until then its rows wait in
    `carry`. Pieces in order of issue keep the carry to the collectives in flight across a
    piece's edge (and those a rank never joined). A rank numbers its collectives of a group
    once each (scheduler/parallel/comm.py): a repeated (group, seq, rank) is not expected."""

    def __init__(self, members: dict[str, set[int]]) -> None:
        self.names = sorted(members)
        self.ids = {g: i for i, g in enumerate(self.names)}
        self.members = np.array([len(members[g]) for g in self.names], dtype=np.int64)
        self.carry = [np.zeros(0, np.int64) for _ in range(5)]  # group, seq, rank, issue, step
        self.late: list[np.ndarray] = []  # ns, one per collective every member issued
        # rank -> [times last, sum ns, max ns]
        self.last = {r: [0, 0, 0] for r in sorted(set().union(*members.values()))}
        self.worst: list[tuple[int, str, int, int, int]] = []  # (-late ns, group, seq, step, rank)

    def carried(self) -> int:
        """Rows waiting for the rest of their collective's members."""
        return len(self.carry[0])

    def _group_ids(self, col: pa.ChunkedArray) -> np.ndarray:
        out = [np.array([self.ids.get(v, -1) for v in names] or [-1], dtype=np.int64)[idx]
               for names, idx in _dictionary_chunks(col)]
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def add(self, t: pa.Table) -> None:
        if not t.num_rows:
            return
        new = [self._group_ids(t["group"])] + [t[c].to_numpy().astype(np.int64, copy=False)
                                                 for c in ("seq", "rank", "issue_ns", "step")]
        gk, seq, rank, issue, step = (np.concatenate([c, n]) for c, n in zip(self.carry, new, strict=True))
        known = gk >= 0
        if not known.all():
            gk, seq, rank, issue, step = gk[known], seq[known], rank[known], issue[known], step[known]
        key = (gk << SEQ_BITS) | seq
        run, count, first, last = group_runs(key, rank, issue)
        want = self.members[key[first] >> SEQ_BITS]
        keep = (count < want)[run]
        self.carry = [gk[keep], seq[keep], rank[keep], issue[keep], step[keep]]
        full = (count == want) & (count > 1)
        if not full.any():
            return
        first, last = first[full], last[full]
        late, last_rank = issue[last] - issue[first], rank[last]
        # kept to the end for the percentiles (28 M on tp100m): in 32 bits where they fit (< 4.3 s), exactly
        self.late.append(late.astype(np.uint32) if int(late.max()) < 1 << 32 else late)
        for r in range(int(last_rank.min()), int(last_rank.max()) + 1):  # (the ranks are few: no hash)
            lat = late[last_rank == r]
            if not len(lat):
                continue
            acc = self.last.setdefault(int(r), [0, 0, 0])
            acc[0] += len(lat)
            acc[1] += int(lat.sum())
            acc[2] = max(acc[2], int(lat.max()))
        fk = key[first]
        top = np.arange(len(late))
        if len(late) > WORST:  # the latest few, and every one tied with the last of them
            top = np.flatnonzero(late >= np.partition(late, len(late) - WORST)[len(late) - WORST])
            top = top[np.lexsort((fk[top], -late[top]))[:WORST]]  # (the key orders by group name, then seq)
        for i in top.tolist():  # (a collective's step: its first issuer's)
            self.worst.append((-int(late[i]), self.names[int(fk[i] >> SEQ_BITS)], int(fk[i] & SEQ_MASK),
                               int(step[first[i]]), int(last_rank[i])))
        self.worst = sorted(self.worst)[:WORST]

    def view(self) -> StragglerView | None:
        """None when no collective was issued by every member of its group (two or more)."""
        if not self.late:
            return None
        late_ms = np.concatenate(self.late, dtype=np.float64)  # (one copy at a time: a long run has tens of M)
        self.late.clear()
        late_ms /= 1e6
        n = len(late_ms)
        ranks = [RankLateness(r, k, k / n, total / k / 1e6 if k else 0.0, mx / 1e6)
                 for r, (k, total, mx) in sorted(self.last.items())]
        worst = [Straggler(g, q, st, r, -neg / 1e6) for neg, g, q, st, r in self.worst]
        p50, p99 = (float(x) for x in np.percentile(late_ms, [50, 99], overwrite_input=True))
        return StragglerView(n, p50, p99, ranks, worst)


def group_runs(key: np.ndarray, rank: np.ndarray,
               issue: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows grouped by key: (run, count, first, last), where run[i] numbers row i's group,
    and per group its row count, its first row (the least issue; a tie goes to the lower
    rank, then the earlier row) and its last (the greatest issue; a tie goes to the higher
    rank, then the later row); the groups numbered in key order. A stable sort of the keys
    (cheap: rows in order of issue come nearly sorted by (group, seq)), then one pass over it
    in C where it was built (numpy's gathers and reductions per group were most of the
    straggler join); else a sort by (key, issue, rank)."""
    if native.AVAILABLE:
        return native.group_sorted(key, rank, issue, np.argsort(key, kind="stable"))
    order = np.lexsort((rank, issue, key))  # (three keys: slower than the C pass's one, the same groups)
    k = key[order]
    head = np.ones(len(k), dtype=bool)
    head[1:] = k[1:] != k[:-1]
    starts = np.flatnonzero(head)
    count = np.diff(np.append(starts, len(k)))
    run = np.empty(len(k), dtype=np.int64)
    run[order] = np.repeat(np.arange(len(starts)), count)
    return run, count, order[starts], order[starts + count - 1]


def straggler_view(colls: pa.Table) -> StragglerView | None:
    """None when the trace has no collective issued by more than one rank."""
    group_ranks: dict[str, set[int]] = {}
    add_members(colls, group_ranks)
    fold = StragglerFold(group_ranks)
    fold.add(colls)
    return fold.view()


def trace_stragglers(trace: Trace, piece_rows: int = READ_ROWS) -> tuple[int, StragglerView | None]:
    """The collectives rows of a trace and their `straggler_view`, read about `piece_rows` at
    a time in order of issue (a long TP run issues about one for every two probe rows)."""
    if not trace.has_table("collectives"):
        return 0, None

    def fold() -> tuple[int, StragglerView | None]:
        f = StragglerFold(trace_members(trace))
        sw = Sweep(trace, "collectives", list(FOLD_COLUMNS), time="issue_ns", dictionary=("group",))
        for t in sw.pieces_ahead(piece_rows):
            f.add(t)
        return sw.rows, f.view()
    return start_over(trace, "collectives", fold)


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


def trace_members(trace: Trace) -> dict[str, set[int]]:
    """`members` of a trace's collectives. The row groups of one collectives group's rows give
    its member ranks from their statistics (`Sweep.values_in`); a row group of several groups'
    rows, or with nulls, is read (a pass over the whole table took 0.6 s of a 100 M-row TP
    report, all before the stream's first window)."""
    out: dict[str, set[int]] = {}
    sw = Sweep(trace, "collectives", ["group", "rank"], time=None, dictionary=("group",), ranges=("group", "rank"))
    of_one: dict[str, list[Group]] = {}
    for g in (g for g in sw.groups if g.rows):
        names = g.ranges[0]
        if names is not None and names[0] == names[1] and isinstance(names[0], str) and g.nulls == [0, 0]:
            of_one.setdefault(names[0], []).append(g)
        else:
            add_members(sw.stored(g, ["group", "rank"]), out)
    for name, groups in of_one.items():
        ranks = sw.values_in(groups, 1, MAX_RANK_SPAN)
        if ranks is not None:
            out.setdefault(name, set()).update(ranks)
            continue
        for g in groups:
            add_members(sw.stored(g, ["group", "rank"]), out)
    return out


def add_members(t: pa.Table, out: dict[str, set[int]]) -> None:
    """Add the (group, rank) pairs of `t` to `out` (group -> ranks)."""
    rank = t["rank"].to_numpy().astype(np.int64)
    at = 0
    for names, idx in _dictionary_chunks(t["group"]):
        r = rank[at:at + len(idx)]
        at += len(idx)
        if not len(r):
            continue
        lo, span = int(r.min()), int(r.max() - r.min()) + 1
        pairs = idx * span + (r - lo)
        # ranks are few and small: a count, not a hash (unless a bad trace's are not)
        seen = np.flatnonzero(np.bincount(pairs)) if span * len(names) <= 1 << 20 else np.unique(pairs)
        for p in seen.tolist():
            out.setdefault(names[p // span], set()).add(lo + p % span)


def _dictionary_chunks(col: pa.ChunkedArray) -> Iterator[tuple[list[str], np.ndarray]]:
    """Each chunk of a string column as its names and int64 indices into them (chunks read
    from different parts have dictionaries of their own)."""
    for ch in col.chunks:
        if not pa.types.is_dictionary(ch.type):
            ch = ch.dictionary_encode()
        yield ch.dictionary.to_pylist(), ch.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def never_joined(last: dict[tuple[str, int], int], group: str, seq: int, members: list[int]) -> dict[int, int]:
    """Member ranks of ``group`` that never issued collective ``seq`` (`last`: `last_seqs`):
    {rank: its last seq (-1: none)}."""
    out = {r: last.get((group, r), -1) for r in members}
    return {r: s for r, s in out.items() if s < seq}
