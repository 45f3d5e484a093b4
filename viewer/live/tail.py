"""Following a trace that is still being written: each poll reads only the parts
committed since the last one.

A rank's rows in a table only ever append, and compaction merges parts in place
(tracing/manifest.py), so "the first N rows of rank r" names the same rows before
and after a merge. The tail keeps that N per (table, rank) and, on a poll, reads
just the parts past it (slicing the one it lands inside). It never re-reads what
it has, so a refresh costs the new flushes, not the trace's size. Attaching to a
long run starts `backlog` rows from each table's end: what a live view shows is
the recent past, and the header's totals come from the manifests' row counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from tracing.manifest import part_rank
from tracing.reader import Part, Trace, read_parts
from tracing.run_status import RunStatus
from tracing.schema import TABLES

# What each table contributes to a live view; the text and id-list columns stay on disk.
COLUMNS: dict[str, list[str]] = {
    "probes": ["ts_ns", "dur_ns", "boundary", "stream", "rank", "step"],
    "steps": list(TABLES["steps"].names),
    "requests": ["request_id", "prompt_len", "output_len", "cached_prefix_len", "finish_reason", "arrival_ns",
                 "first_token_ns", "finish_ns", "num_preemptions", "dur_itl_ns"],
    "memory": ["ts_ns", "step", "kind", "block_id", "request_id", "ref_count"],
    "stalls": ["ts_ns", "rank", "step", "waiter", "what", "signaller", "boundary", "waited_ns", "cycle"],
}
# Rows read from each table's end on attach.
BACKLOG = {"probes": 200_000, "steps": 20_000, "requests": 20_000, "memory": 200_000, "stalls": 1_000}


@dataclass(slots=True)
class Poll:
    """One poll's news: the new rows of each table, and the trace's state."""

    meta: dict[str, Any]
    status: RunStatus
    rows: dict[str, pa.Table] = field(default_factory=dict)
    committed: dict[str, int] = field(default_factory=dict)  # rows committed so far, per table (all ranks)
    skipped: dict[str, int] = field(default_factory=dict)  # rows never read, per table: attached mid-run

    @property
    def new_rows(self) -> int:
        return sum(t.num_rows for t in self.rows.values())


class TraceTail:
    def __init__(self, root: str | Path, tables: dict[str, list[str]] | None = None,
                 backlog: dict[str, int] | None = None) -> None:
        self.root = Path(root)
        self.tables = COLUMNS if tables is None else tables
        self._backlog = BACKLOG if backlog is None else backlog
        self._seen: dict[tuple[str, int], int] = {}
        self._skipped: dict[str, int] = {}
        self._attached = False

    def poll(self) -> Poll | None:
        """The rows committed since the last poll; None while the trace does not exist yet.
        A corrupt trace raises TraceError."""
        if not (self.root / "meta.json").is_file():
            return None
        trace = Trace.open(self.root)
        out = Poll(trace.meta, trace.status)
        for name, cols in self.tables.items():
            parts = trace.parts.get(name, [])
            out.committed[name] = sum(p.rows or 0 for p in parts)
            if not trace.has_table(name):
                out.rows[name] = _empty(name, cols)
            elif trace.legacy:  # no row counts to follow: a trace from before manifests is read once
                out.rows[name] = trace.table(name, cols) if not self._attached else _empty(name, cols)
            else:
                out.rows[name] = self._new_rows(name, cols, parts)
            out.skipped[name] = self._skipped.get(name, 0)
        self._attached = True
        return out

    def _new_rows(self, name: str, cols: list[str], parts: list[Part]) -> pa.Table:
        by_rank: dict[int, list[Part]] = {}
        for p in parts:
            by_rank.setdefault(part_rank(p.path.name), []).append(p)
        pieces = []
        for rank, ps in sorted(by_rank.items()):
            total = sum(p.rows or 0 for p in ps)
            key = (name, rank)
            if key not in self._seen:  # first sight: start near the end
                self._seen[key] = max(0, total - self._backlog.get(name, 0)) if not self._attached else 0
                self._skipped[name] = self._skipped.get(name, 0) + self._seen[key]
            seen = self._seen[key]
            if total <= seen:
                continue
            want: list[Part] = []
            skip, at = 0, 0
            for p in ps:
                n = p.rows or 0
                if at + n > seen:
                    if not want:
                        skip = seen - at
                    want.append(p)
                at += n
            try:
                t = read_parts(want, TABLES[name], cols)
            except FileNotFoundError:
                continue  # compacted away since the manifest was read: the next poll sees its merge
            pieces.append(t.slice(skip))
            self._seen[key] = total
        if not pieces:
            return _empty(name, cols)
        return pa.concat_tables(pieces).unify_dictionaries() if len(pieces) > 1 else pieces[0]


def _empty(name: str, cols: list[str]) -> pa.Table:
    return pa.schema([TABLES[name].field(c) for c in cols]).empty_table()
