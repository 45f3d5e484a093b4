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
import pyarrow.compute as pc

_PLUS = pa.array(["alloc", "ref"])
_MINUS = pa.array(["free", "unref", "reclaim"])


def fold_holders(mem: pa.Table, held: dict[str, int], restart: bool = False) -> tuple[pa.Table, bool]:
    """Fold `mem`'s events into `held` (request id -> blocks; a request at 0 is dropped).
    `restart`: start from the last snapshot in `mem`, if any (the rows before it are
    then not returned). Returns the rows folded and whether a snapshot restarted."""
    kind = mem["kind"].cast(pa.string())
    begin = (np.flatnonzero(pc.equal(kind, "snapshot_begin").to_numpy(zero_copy_only=False)) if restart
             else np.zeros(0, np.intp))
    restarted = bool(len(begin))
    plus_kinds = _PLUS
    if restarted:
        cut = int(begin[-1]) + 1
        mem, kind = mem.slice(cut), kind.slice(cut)
        held.clear()
        plus_kinds = pa.array(["alloc", "ref", "snapshot"])  # the listing gives the counts to start from
    if not mem.num_rows:
        return mem, restarted
    plus = pc.is_in(kind, plus_kinds).to_numpy(zero_copy_only=False)
    minus = pc.is_in(kind, _MINUS).to_numpy(zero_copy_only=False)
    sign = plus.astype(np.int64) - minus.astype(np.int64)
    rid = pc.dictionary_encode(mem["request_id"].cast(pa.string())).combine_chunks()
    delta = np.bincount(rid.indices.to_numpy(zero_copy_only=False), weights=sign, minlength=len(rid.dictionary))
    for name, d in zip(rid.dictionary.to_pylist(), delta.astype(np.int64).tolist(), strict=True):
        if d and name:
            n = held.get(name, 0) + d
            if n > 0:
                held[name] = n
            else:
                held.pop(name, None)
    return mem, restarted
