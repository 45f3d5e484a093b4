"""`mstrace compact`: merge a finished or killed trace's parts, crash-safely.

A trace from a killed run keeps every small part it flushed (and maybe files no
manifest names: a flush or merge cut short); a trace from before manifests has
no commit record at all. `compact_trace` first gives a legacy trace manifests
naming exactly its parts (and only then marks meta.json, so a reader sees either
the legacy layout or the committed one), then merges through the same commit
path as a running writer (tracing/writer.py PartStore), then removes the files no
manifest names. It refuses a trace whose writer is still running.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tracing.compaction import Targets
from tracing.manifest import (
    STORE,
    Manifest,
    ManifestError,
    PartEntry,
    legacy_parts,
    max_seq_on_disk,
    part_rank,
    read_manifests,
    write_manifest,
)
from tracing.reader import Trace, TraceError, read_meta
from tracing.schema import TABLES
from tracing.store_lock import WriterLock, live_ranks
from tracing.writer import PartStore, write_json_atomic


@dataclass(slots=True)
class CompactResult:
    parts_before: int
    parts_after: int
    merges: int
    removed: int  # uncommitted files deleted


def compact_trace(root: str | Path, targets: Targets | None = None) -> CompactResult:
    r = Path(root)
    meta = read_meta(r)
    live = live_ranks(r)
    if live:
        raise TraceError(f"trace {r} is still being written (rank {live[0]}'s writer is running); "
                         "compact it when the run has ended")
    _verify(Trace.open(r))
    if meta.get("store") != STORE:
        _adopt_legacy(r, meta)
    try:
        manifests = read_manifests(r)
    except ManifestError as e:
        raise TraceError(f"trace {r}: {e}") from None
    locks: list[WriterLock] = []
    try:
        for m in manifests:  # no run, and no other compact, may write meanwhile
            locks.append(WriterLock.acquire(r, m.rank))
    except RuntimeError as e:
        for lk in locks:
            lk.release()
        raise TraceError(str(e)) from None
    try:
        before = sum(len(es) for m in manifests for es in m.tables.values())
        merges = 0
        for m in manifests:
            m.next_seq = max(m.next_seq, max_seq_on_disk(r, m.rank, list(TABLES)) + 1)
            try:
                merges += PartStore(r, m, TABLES, targets or Targets()).compact(final=True)
            except (pa.ArrowException, OSError, ManifestError) as e:
                # Every part read whole in _verify: an error now is the machine's, not the trace's
                # (the CLI names a full disk or a read-only folder; the commits kept every row).
                if isinstance(e, OSError) and e.errno is not None:
                    raise
                why = str(e).splitlines()[0] if str(e) else repr(e)
                if isinstance(e, pa.ArrowMemoryError):
                    raise TraceError(f"cannot compact {r}: out of memory ({why}); no row was lost") from None
                raise TraceError(f"corrupt trace {r}: {why}") from None
        after = sum(len(es) for m in manifests for es in m.tables.values())
        removed = _remove_uncommitted(r, manifests)
    finally:
        for lk in locks:
            lk.release()
    return CompactResult(before, after, merges, removed)


def _verify(tr: Trace) -> None:
    """Every committed part must read whole before anything is rewritten: a corrupt
    trace is refused untouched, never half compacted. Read as a stream, so the check
    holds a batch of rows in memory, not a part (tracing/reader.py Trace.verify)."""
    for t in tr.parts:
        if t in TABLES:
            tr.verify(t)  # TraceError for a missing, truncated, garbled or mistyped part


def _adopt_legacy(r: Path, meta: dict[str, object]) -> None:
    """Commit a legacy trace's parts as they are, one manifest per rank that wrote some."""
    by_rank: dict[int, Manifest] = {}
    for t in TABLES:
        if not (r / t).is_dir():
            continue
        for f in legacy_parts(r, t):
            rank = part_rank(f)
            try:
                md = pq.read_metadata(r / t / f)
            except (pa.ArrowException, OSError) as e:
                raise TraceError(f"corrupt {t}/ table in {r}: {f}: {str(e).splitlines()[0]}") from None
            m = by_rank.setdefault(rank, Manifest(rank))
            nbytes = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
            m.tables.setdefault(t, []).append(PartEntry(f, md.num_rows, nbytes, 0, md.num_row_groups))
    by_rank.setdefault(0, Manifest(0))
    for m in by_rank.values():
        m.next_seq = max_seq_on_disk(r, m.rank, list(TABLES)) + 1
        m.epoch = 1
        write_manifest(r, m)
    # The switch: until meta.json names the store, readers take every part, as before.
    write_json_atomic(r / "meta.json", {**meta, "store": STORE})


def _remove_uncommitted(r: Path, manifests: list[Manifest]) -> int:
    named = {(t, e.file) for m in manifests for t, es in m.tables.items() for e in es}
    removed = 0
    for t in TABLES:
        d = r / t
        if not d.is_dir():
            continue
        for p in d.iterdir():
            stray_tmp = p.name.startswith(".part-") and p.name.endswith(".tmp")
            if (p.name.startswith("part-") and p.name.endswith(".parquet") and (t, p.name) not in named) or stray_tmp:
                p.unlink(missing_ok=True)
                removed += 1
    return removed
