"""How many KV blocks each request holds, folded from memory events, vectorized.

A busy run writes thousands of memory events a second, and a long trace millions, so
the fold is column-wise: each event that gives a request a block reference (alloc,
ref) counts +1 for it, each that takes one away (free, unref, reclaim) -1.

A snapshot (`--snapshot-every`) lists the running requests' block tables: a reader
that missed the events before it (`mstrace top` attached to a long run) restarts its
counts there. It does not list blocks whose holder died without freeing them (the
leak a leak check looks for), so a reader that has every event from the start never
restarts. `mstrace top` (viewer/live/state.py) folds each poll's events; the Perfetto
export folds a whole trace, part by part, for its leak instants.
(`mstrace leaks` replays block by block, viewer/analysis/leak_replay.py, to name the
blocks and reconcile anomalies; this keeps only the counts.)
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from viewer.analysis.cycle_views import codes

_PLUS = ("alloc", "ref")
_MINUS = ("free", "unref", "reclaim")


def fold_holders(mem: pa.Table, held: dict[str, int], restart: bool = False) -> tuple[pa.Table, bool]:
    """Fold `mem`'s events into `held` (request id -> blocks; a request at 0 is dropped).
    `restart`: start from the last snapshot in `mem`, if any (the rows before it are
    then not returned). Returns the rows folded and whether a snapshot restarted.
    Both columns are read as dictionary codes: a row costs an integer, not a string."""
    kind, kinds = codes(mem["kind"])
    begin = (np.flatnonzero(kind == kinds.index("snapshot_begin")) if restart and "snapshot_begin" in kinds
             else np.zeros(0, np.intp))
    restarted = bool(len(begin))
    plus_kinds: tuple[str, ...] = _PLUS
    if restarted:
        cut = int(begin[-1]) + 1
        mem, kind = mem.slice(cut), kind[cut:]
        held.clear()
        plus_kinds = (*_PLUS, "snapshot")  # the listing gives the counts to start from
    if not mem.num_rows:
        return mem, restarted
    # a null kind or request id (code -1; the engine writes none) counts for nobody
    sign = np.array([1 if k in plus_kinds else -1 if k in _MINUS else 0 for k in kinds] + [0], dtype=np.int64)
    sign = sign[np.where(kind < 0, len(kinds), kind)]
    rid, names = codes(mem["request_id"])
    ok = rid >= 0
    delta = np.bincount(rid[ok], weights=sign[ok], minlength=len(names)).astype(np.int64)
    for i in np.flatnonzero(delta).tolist():
        name = names[i]
        if name:
            n = held.get(name, 0) + int(delta[i])
            if n > 0:
                held[name] = n
            else:
                held.pop(name, None)
    return mem, restarted
