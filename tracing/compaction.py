"""Merging a table's many small parts into few large ones.

A run flushes every second (writer.FLUSH_INTERVAL_S), so an hour of serving leaves
thousands of parts per table, and reading thousands of small files (and as many row groups) costs a
reader far more than the rows in them. Compaction is size-tiered, like an LSM
tree's: `fan_in` consecutive parts of one level become one part of the next, so
every row is rewritten about log_fan_in(target / flush) times, and a part that
reaches about half the target (`max_rows` rows or `max_bytes` of Arrow memory)
is sealed and never rewritten again. Only consecutive parts are merged, in commit
order, so the rows of a table keep the order they were written in (readers rely
on it for ties in time). At the end of a run, and in `mstrace compact`, every
run of unsealed parts is packed into as few parts as the targets allow.

Merged parts are written with row groups of up to `max_rows` rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from tracing.manifest import SEALED, PartEntry

FAN_IN = 8
MAX_ROWS = 1 << 20  # about 1 M rows per row group
MAX_BYTES = 256 << 20  # a compaction batch's Arrow memory: the requests table's token lists are large


@dataclass(frozen=True, slots=True)
class Targets:
    fan_in: int = FAN_IN
    max_rows: int = MAX_ROWS
    max_bytes: int = MAX_BYTES

    def sealed(self, rows: int, nbytes: int) -> bool:
        return rows * 2 > self.max_rows or nbytes * 2 > self.max_bytes


@dataclass(frozen=True, slots=True)
class Merge:
    start: int  # entries[start:stop] become one part
    stop: int
    level: int  # the merged part's level


def plan_tiered(entries: list[PartEntry], t: Targets) -> Iterator[Merge | int]:
    """During a run: `fan_in` consecutive parts of one level merge into the next level.
    Yields a Merge, or the index of a part to seal in place (it cannot merge with its
    neighbour without passing a target). Indices refer to `entries` as given."""
    i, n = 0, len(entries)
    while i < n:
        lvl = entries[i].level
        if lvl == SEALED:
            i += 1
            continue
        j, rows, nbytes = i, 0, 0
        while (j < n and entries[j].level == lvl and j - i < t.fan_in
               and rows + entries[j].rows <= t.max_rows and nbytes + entries[j].nbytes <= t.max_bytes):
            rows, nbytes = rows + entries[j].rows, nbytes + entries[j].nbytes
            j += 1
        blocked = j < n and entries[j].level == lvl and j - i < t.fan_in  # a target stopped the run
        if j - i == t.fan_in or (blocked and j - i >= 2):
            yield Merge(i, j, SEALED if t.sealed(rows, nbytes) else lvl + 1)
        elif blocked or (j == i):
            yield i  # alone it is as large as it may get next to its neighbour
            j = max(j, i + 1)
        i = j


def groups_allowed(e: PartEntry, t: Targets) -> int:
    """The row groups a part may hold before it is rewritten alone (a part left by one flush
    per row group holds thousands). A merge writes groups of max_rows rows where they fit in
    max_bytes (one group per max_rows), or, streamed (`mstrace compact`), cuts one where
    the next batch would pass either target: two neighbours then hold more than one target's
    worth, so at most 2 * (rows / max_rows + nbytes / max_bytes) + 2 groups, and a part
    rewritten once is never rewritten again."""
    return 2 * (-(-e.rows // t.max_rows) + -(-e.nbytes // t.max_bytes)) + 2


def plan_full(entries: list[PartEntry], t: Targets) -> Iterator[Merge]:
    """At the end: pack each run of consecutive parts below the targets into parts within
    them (and rewrite a part alone whose row groups are smaller than its rows need)."""
    i, n = 0, len(entries)

    def full(e: PartEntry) -> bool:  # (a part sealed only because its neighbour was large still packs)
        return t.sealed(e.rows, e.nbytes)

    while i < n:
        if full(entries[i]) and entries[i].row_groups <= groups_allowed(entries[i], t):
            i += 1
            continue
        j, rows, nbytes = i, 0, 0
        while (j < n and (j == i or not full(entries[j]))
               and (j == i or (rows + entries[j].rows <= t.max_rows and nbytes + entries[j].nbytes <= t.max_bytes))):
            rows, nbytes = rows + entries[j].rows, nbytes + entries[j].nbytes
            j += 1
        if j - i >= 2 or entries[i].row_groups > groups_allowed(entries[i], t):
            # (a part alone is rewritten when it holds more row groups than its rows need)
            yield Merge(i, j, SEALED if t.sealed(rows, nbytes) else max(e.level for e in entries[i:j]) + 1)
        i = j
