"""One table of a trace read in time order, a bounded number of rows at a time.

A long run's table is millions of row groups' worth of rows: an analysis that holds
them all holds gigabytes (`report` on 100 M probe rows: 7.2 GB). Every row group's
footer statistics give the earliest start time in it, so the groups sorted by that
can be read in windows: after `read_until(t)`, every row that starts before t has
been read, and only the groups that can hold one were. The caller keeps what it
still needs of the earlier rows (viewer/analysis/cycle_stream.py keeps the rows
that overlap its next window).

Rows are read as the committed snapshot `Trace.open` took. A part that a live
compaction removed meanwhile raises `Vanished`: the caller reopens the trace and
starts over (rows only ever append and merges keep their order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tracing.reader import Part, Trace, TraceError, check_never_null, read_row_groups
from tracing.schema import TABLES

NEVER = np.iinfo(np.int64).max
EARLIEST = np.iinfo(np.int64).min
TRIES = 5  # a live compaction can replace a part mid-read: start over on a new snapshot
T = TypeVar("T")


class Vanished(Exception):
    """A committed part is gone: a live compaction replaced it after the snapshot."""


def start_over(trace: Trace, name: str, read: Callable[[], T]) -> T:
    """`read()`, a pass over `name` through Sweeps, started over on a newer snapshot (its
    clipped count as before) when a part vanished; TraceError after TRIES, or at once on a
    legacy trace (no manifest: a missing part is simply missing)."""
    clipped = trace.status.clipped.get(name, 0)
    for attempt in range(TRIES):
        try:
            return read()
        except Vanished as e:
            if trace.legacy or attempt == TRIES - 1:
                raise TraceError(f"corrupt {name}/ table in {trace.root}: the manifest names {e}, "
                                 "which is missing") from None
            trace.reopen()
            trace.status.clipped[name] = clipped
    raise AssertionError  # pragma: no cover - the loop returns or raises


@dataclass(slots=True)
class Group:
    part: Part
    index: int  # the row group's index in its part
    rows: int
    first_ns: int  # the earliest start in it; EARLIEST without statistics (read first)
    row0: int  # its first row's place in the table as `Trace.table` reads it (parts in order)
    # (min, max) of each `ranges` column, nulls aside; None without statistics
    ranges: list[tuple[Any, Any] | None]
    nulls: list[int | None]  # each `ranges` column's nulls (None: not known)

    def int_range(self, i: int) -> tuple[int, int] | None:
        """The `i`th `ranges` column's (min, max) where both are integers (a mistyped column's
        are not: None, and the read that follows refuses it)."""
        b = self.ranges[i]
        return b if b is not None and all(type(v) is int for v in b) else None


class Sweep:
    """`name`'s row groups in order of their earliest `time` value (None: in the order
    `Trace.table` reads them), read on demand.

    `clip`: applied to every read (an unfinished run's rows past its last round).
    `dictionary`: string columns read dictionary-encoded, as Parquet stores them.
    `ranges`: columns whose range (and count of nulls) in each group is kept from its statistics.
    `position`: the name of an int64 column added to every read, each row's place in the
    whole table (`Group.row0` on): the order of rows that tie on `time`."""

    def __init__(self, trace: Trace, name: str, columns: list[str], time: str | None = "ts_ns",
                 clip: Callable[[pa.Table], pa.Table] | None = None, dictionary: tuple[str, ...] = (),
                 ranges: tuple[str, ...] = (), position: str | None = None) -> None:
        self.trace, self.name, self.columns, self.clip, self.position = trace, name, columns, clip, position
        self.dictionary = tuple(c for c in dictionary if c in columns)
        self.ranges = ranges
        self.groups = sorted(_groups(trace, name, time, ranges), key=lambda g: g.first_ns)
        self.rows = sum(g.rows for g in self.groups)
        self.at = 0  # the next group to read

    def next_first(self) -> int:
        """The earliest start any unread row can have (NEVER when every group is read)."""
        return self.groups[self.at].first_ns if self.at < len(self.groups) else NEVER

    def read_until(self, t: int | None) -> list[pa.Table]:
        """Every unread group that can hold a row starting before `t` (None: every one),
        consecutive groups of one part in one read."""
        stop = len(self.groups) if t is None else self.at
        while t is not None and stop < len(self.groups) and self.groups[stop].first_ns < t:
            stop += 1
        return self._read_to(stop)

    def read_next(self, rows: int) -> list[pa.Table]:
        """The next unread groups in order, at least one, until they hold `rows` rows or more."""
        stop, got = self.at, 0
        while stop < len(self.groups) and (stop == self.at or got < rows):
            got += self.groups[stop].rows
            stop += 1
        return self._read_to(stop)

    def pieces(self, rows: int) -> Iterator[pa.Table]:
        """Every unread group, `read_next(rows)` after `read_next(rows)`: a whole table in
        bounded memory, for a pass that does not care about time order."""
        while self.at < len(self.groups):
            yield from self.read_next(rows)

    def pieces_ahead(self, rows: int) -> Iterator[pa.Table]:
        """`pieces(rows)`, each next read on a thread of its own while the caller works on the
        one before (reading is mostly decoding, which releases the GIL)."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            ahead = pool.submit(self.read_next, rows) if self.at < len(self.groups) else None
            while ahead is not None:
                got = ahead.result()
                ahead = pool.submit(self.read_next, rows) if self.at < len(self.groups) else None
                yield from got

    def _read_to(self, stop: int) -> list[pa.Table]:
        out: list[pa.Table] = []
        k = self.at
        while k < stop:
            j = k + 1
            while j < stop and self.groups[j].part is self.groups[k].part:
                j += 1
            out.append(self._read(self.groups[k:j]))
            k = j
        self.at = stop
        return out

    def values_in(self, groups: list[Group], i: int, limit: int) -> set[int] | None:
        """The values of the `i`th `ranges` (integer) column in `groups`, nulls aside: a group's
        least and greatest are present; a value strictly between a group's two and no group's
        bound is looked for in the groups that could hold it, one at a time until found. None
        where a group has rows and no integer statistics, or spans more than `limit` values."""
        bounds = []
        for g in (g for g in groups if g.rows):  # (an empty group has no statistics, and no values)
            b = g.int_range(i)
            if b is None or b[1] - b[0] > limit:
                return None
            bounds.append((g, b[0], b[1]))
        present = {v for _, lo, hi in bounds for v in (lo, hi)}
        between = {v for _, lo, hi in bounds for v in range(lo + 1, hi)} - present
        name = self.ranges[i]
        for g, lo, hi in bounds:
            if not between:
                break
            if any(lo < v < hi for v in between):
                found = set(pc.unique(self.stored(g, [name])[name]).to_pylist()) & between
                present |= found
                between -= found
        return present

    def stored(self, g: Group, columns: list[str]) -> pa.Table:
        """One group's `columns` as stored: not clipped, no position, whatever was read before."""
        return self._fetch([g], columns)

    def _fetch(self, groups: list[Group], columns: list[str]) -> pa.Table:
        part = groups[0].part
        try:
            t = read_row_groups(part, TABLES[self.name], columns, [g.index for g in groups],
                                tuple(c for c in self.dictionary if c in columns))
        except FileNotFoundError:
            raise Vanished(part.path.name) from None
        except TraceError as e:
            raise TraceError(f"corrupt {self.name}/ table in {self.trace.root}: {e}") from None
        check_never_null(t, self.name, self.trace.root)
        return t

    def _read(self, groups: list[Group]) -> pa.Table:
        t = self._fetch(groups, self.columns)
        if self.position is not None:
            pos = np.concatenate([np.arange(g.row0, g.row0 + g.rows, dtype=np.int64) for g in groups])
            t = t.append_column(self.position, pa.array(pos))
        return self.clip(t) if self.clip is not None else t


def _groups(trace: Trace, name: str, time: str | None, ranges: tuple[str, ...]) -> list[Group]:
    """Every committed part's row groups from its footer (the manifest's row count checked)."""
    out: list[Group] = []
    row0 = 0
    for p in trace.parts.get(name, []):
        try:
            md = pq.ParquetFile(p.path, pre_buffer=False).metadata
        except FileNotFoundError:
            raise Vanished(p.path.name) from None
        except (pa.ArrowException, OSError, ValueError) as e:
            raise TraceError(f"corrupt {name}/ table in {trace.root}: {p.path.name}: {e}") from None
        if p.rows is not None and md.num_rows != p.rows:
            raise TraceError(f"corrupt {name}/ table in {trace.root}: {p.path.name} holds {md.num_rows} rows, "
                             f"the manifest committed {p.rows}")
        names = md.schema.to_arrow_schema()
        col = names.get_field_index(time) if time is not None else -1
        extra = [names.get_field_index(c) for c in ranges]
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            first = _min_max(rg, col)
            stats = [rg.column(c).statistics if c >= 0 else None for c in extra]  # (a missing column: read, and refused)
            out.append(Group(p, g, rg.num_rows, first[0] if first is not None else EARLIEST, row0,
                             [(st.min, st.max) if st is not None and st.has_min_max else None for st in stats],
                             [st.null_count if st is not None and st.has_null_count else None for st in stats]))
            row0 += rg.num_rows
    return out


def _min_max(rg: pq.RowGroupMetaData, col: int) -> tuple[int, int] | None:
    st = rg.column(col).statistics if col >= 0 else None
    return (int(st.min), int(st.max)) if st is not None and st.has_min_max else None
