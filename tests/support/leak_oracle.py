"""Reference oracle for `viewer.analysis.leaks.leak_report`: the original
pure-Python replay, kept verbatim (apart from its name) so the vectorised
implementation can be checked against it on generated inputs. Slow on purpose:
it is the easy-to-read definition of what the report means.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from viewer.analysis.leaks import MAX_ANOMALIES, HeldBlocks, LeakReport, frag_point


@dataclass(slots=True)
class _Snap:
    ts_ns: int
    step: int
    free_reported: int | None = None
    listed: set[int] = field(default_factory=set)  # blocks the snapshot shows held
    replay_held: set[int] = field(default_factory=set)  # blocks the replay holds at that moment


def oracle_leak_report(memory: pa.Table, requests: pa.Table, capacity: int, run_ended: bool) -> LeakReport:
    """The replay as it was before vectorising, event by event: the reference for leak_report."""
    m = memory.to_pydict()
    ts, steps, kinds = m["ts_ns"], m["step"], m["kind"]
    bids, rids, refs = m["block_id"], m["request_id"], m["ref_count"]
    # sorted() is stable: equal timestamps keep file order, which is emission order within a producer.
    order = sorted(range(memory.num_rows), key=ts.__getitem__)

    holders: dict[int, dict[str, int]] = {}  # block -> {request: references}; absent = free
    reclaimed: dict[str, list[int]] = {}
    anomalies: list[str] = []
    n_anom = 0
    snaps: dict[int, _Snap] = {}
    events = 0
    max_bid = -1

    def anomaly(msg: str) -> None:
        nonlocal n_anom
        n_anom += 1
        if len(anomalies) < MAX_ANOMALIES:
            anomalies.append(msg)

    for i in order:
        kind, bid, rid = kinds[i], bids[i], rids[i] or ""
        if bid is not None and bid > max_bid:
            max_bid = bid
        if kind == "snapshot_begin":
            s = snaps.setdefault(ts[i], _Snap(ts[i], steps[i]))
            s.free_reported = refs[i]
            s.replay_held = set(holders)
            continue
        if kind == "snapshot":
            snaps.setdefault(ts[i], _Snap(ts[i], steps[i])).listed.add(bid)
            continue
        events += 1
        h = holders.get(bid)
        if kind == "alloc":
            if h:
                anomaly(f"ts {ts[i]}: alloc of block {bid} to {rid} while held by {sorted(h)}")
            holders[bid] = {rid: 1}
        elif kind == "ref":
            h = holders.setdefault(bid, {})  # a ref may revive a free prefix block
            h[rid] = h.get(rid, 0) + 1
        elif kind == "unref":
            if not h or rid not in h:
                anomaly(f"ts {ts[i]}: unref of block {bid} by {rid}, which does not hold it")
                continue
            h[rid] -= 1
            if h[rid] == 0:
                del h[rid]
            if not h:
                # The engine says others still hold it; the replay lost them.
                anomaly(f"ts {ts[i]}: unref of block {bid} by {rid} left no holder (ref_count {refs[i]})")
                del holders[bid]
        elif kind == "free":
            if not h:
                anomaly(f"ts {ts[i]}: free of block {bid} by {rid}, which is already free")
            elif set(h) != {rid} or h[rid] != 1:
                anomaly(f"ts {ts[i]}: free of block {bid} by {rid} while held by {h}")
            holders.pop(bid, None)
        elif kind == "reclaim":
            # The GC drops the dead holder's reference: a free when it was the
            # last one (ref_count 0 after), an unref of a shared block otherwise.
            reclaimed.setdefault(rid, []).append(bid)
            if not h or rid not in h:
                anomaly(f"ts {ts[i]}: reclaim of block {bid} from {rid}, which does not hold it")
            else:
                h[rid] -= 1
                if h[rid] == 0:
                    del h[rid]
            if refs[i] == 0 or not holders.get(bid):
                if holders.get(bid):
                    anomaly(f"ts {ts[i]}: reclaim freed block {bid} still held by {holders[bid]}")
                holders.pop(bid, None)
        else:
            events -= 1
            anomaly(f"ts {ts[i]}: unknown memory event kind {kind!r}")
            continue
        if kind in ("ref", "unref", "reclaim") and bid in holders:
            held = sum(holders[bid].values())
            if refs[i] is not None and refs[i] != held:
                anomaly(f"ts {ts[i]}: block {bid} ref_count {refs[i]} but the replay counts {held}")

    inferred = capacity <= 0
    if inferred:
        capacity = max_bid + 1

    req = requests.select(["request_id", "finish_reason"]).to_pydict()
    finished = {r: fr for r, fr in zip(req["request_id"], req["finish_reason"], strict=True) if fr}

    by_req: dict[str, list[int]] = {}
    for bid, h in holders.items():
        for rid in h:
            by_req.setdefault(rid, []).append(bid)
    leaks: list[HeldBlocks] = []
    running: list[HeldBlocks] = []
    for rid in sorted(by_req):
        ids = sorted(by_req[rid])
        if rid in finished:
            leaks.append(HeldBlocks(rid, "finished", finished[rid], ids))
        elif run_ended:
            leaks.append(HeldBlocks(rid, "unknown", None, ids))
        else:
            running.append(HeldBlocks(rid, "running", None, ids))

    frag = []
    all_ids = set(range(capacity))
    for t in sorted(snaps):
        s = snaps[t]
        # A snapshot lists only running requests' tables; blocks held elsewhere
        # (awaiting a device fence) are known to the replay. Free = neither.
        busy = s.listed | s.replay_held
        free_ids = sorted(all_ids - busy)  # set difference runs in C: snapshots x capacity adds up
        frag.append(frag_point(s.ts_ns, s.step, free_ids, capacity, s.free_reported))

    return LeakReport(
        capacity=capacity, capacity_inferred=inferred, run_ended=run_ended, events=events,
        final_held=len(holders), final_free=capacity - len(holders), leaks=leaks,
        still_running=running, reclaimed={k: sorted(v) for k, v in sorted(reclaimed.items())},
        anomalies=anomalies, num_anomalies=n_anom, fragmentation=frag,
    )
