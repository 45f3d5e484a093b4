"""Stalls: the watchdog's reports, read back from the `stalls` table."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from tracing.reader import Trace
from tracing.run_status import RunStatus
from viewer.analysis.records import JsonRecord


@dataclass(slots=True)
class StallRecord:
    ts_ns: int
    rank: int
    step: int
    waiter: str
    what: str
    signaller: str
    boundary: str
    waited_ns: int
    cycle: str  # "" when no wait cycle is reachable from the waiter
    graph: list[dict[str, Any]] = field(default_factory=list)
    streams: list[dict[str, Any]] = field(default_factory=list)
    stacks: list[dict[str, Any]] = field(default_factory=list)
    kv: dict[str, Any] = field(default_factory=dict)
    waits: list[dict[str, Any]] = field(default_factory=list)
    # A stalled collective (TP): the member ranks that never issued it, [{rank, last_seq}]
    # from the collectives table (name_missing_ranks).
    never_joined: list[dict[str, int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class StallsResult(JsonRecord):
    """Everything `stalls` shows (its to_json() is what --json prints)."""

    trace: str  # the trace folder, as given
    status: RunStatus
    count: int
    stalls: list[StallRecord]


def build_stalls(tr: Trace, trace: str) -> StallsResult:
    """The stalls of an open trace (`trace`: its folder as the user gave it), a TP run's with
    the ranks that never joined a stalled collective."""
    # A trace written before the stalls table existed has no folder for it: no stalls recorded.
    recs = stall_records(tr.table("stalls")) if tr.has_table("stalls") else []
    tp = int((tr.meta.get("parallel") or {}).get("tp", 1))
    if recs and tp > 1:
        from viewer.analysis.collectives import trace_last_seqs

        name_missing_ranks(recs, trace_last_seqs(tr), tp)
    return StallsResult(trace, tr.status, len(recs), recs)


def _load(text: str | None, empty: Any) -> Any:
    # A row the watchdog could not fully fill still shows its wait and cycle.
    if not text:
        return empty
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return empty


def stall_records(stalls: pa.Table) -> list[StallRecord]:
    """Every stall in the table in the order the watchdogs noticed them (ties: lower rank, then
    earlier row, first): stall 1 is the first, often the cause of the ones after it."""
    cols = stalls.to_pydict()
    n = stalls.num_rows
    out = [
        StallRecord(
            ts_ns=cols["ts_ns"][i], rank=cols["rank"][i], step=cols["step"][i],
            waiter=cols["waiter"][i] or "", what=cols["what"][i] or "",
            signaller=cols["signaller"][i] or "", boundary=cols["boundary"][i] or "",
            waited_ns=cols["waited_ns"][i], cycle=cols["cycle"][i] or "",
            graph=_load(cols["graph_json"][i], []), streams=_load(cols["streams_json"][i], []),
            stacks=_load(cols["stacks_json"][i], []), kv=_load(cols["kv_json"][i], {}),
            waits=_load(cols["waits_json"][i], []),
        )
        for i in range(n)
    ]
    order = sorted(range(n), key=lambda i: (out[i].ts_ns, out[i].rank, i))
    return [out[i] for i in order]


def interesting_frames(frames: list[str], keep: int = 6) -> tuple[int, list[str]]:
    """(frames hidden, innermost frames worth reading) of one formatted stack.

    threading.py frames are either the start-up frames every thread shares
    (_bootstrap, run) or the inside of Event/Condition.wait under the caller
    that matters; dropping them leaves the engine's own frames, innermost last.
    """
    useful = [f for f in frames if '/threading.py", line' not in f]
    kept = useful[-keep:] if keep > 0 else []
    return len(frames) - len(kept), kept


_COLLECTIVE = re.compile(r"^all_reduce #(\d+)$")


def name_missing_ranks(recs: list[StallRecord], last: dict[tuple[str, int], int], tp_size: int) -> None:
    """What NCCL's flight recorder tells: for each stalled all-reduce wait, the ranks of the TP
    group that never issued that collective (their collective history stops before its sequence
    number; `last`: collectives.last_seqs).  Rewrites ``what`` to say so, e.g.
    ``all_reduce #17 (rank 1 never joined)``."""
    from viewer.analysis.collectives import never_joined

    for r in recs:
        m = _COLLECTIVE.match(r.what)
        if m is None or tp_size < 2:
            continue
        seq, stage = int(m.group(1)), r.rank // tp_size
        peers = [x for x in range(stage * tp_size, (stage + 1) * tp_size) if x != r.rank]
        missing = never_joined(last, f"tp{stage}", seq, peers)
        if missing:
            r.never_joined = [{"rank": x, "last_seq": s} for x, s in sorted(missing.items())]
            who = ", ".join(f"rank {x}" for x in sorted(missing))
            r.what = f"all_reduce #{seq} ({who} never joined)"
