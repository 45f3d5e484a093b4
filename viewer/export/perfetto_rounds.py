"""The Perfetto export's rounds, requests and rare events (viewer/export/perfetto.py).

Rounds and requests are written column-wise (perfetto_bulk.py), in batches; the flows
between them are numbered here: one per (request, round) where the request entered
the batch (a round that ran one of its prefill chunks) or left it (the round of its
last token).
"""

from __future__ import annotations

from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracing.reader import Trace, read_parts
from tracing.schema import TABLES
from viewer.analysis.cycle_views import codes
from viewer.analysis.holders import fold_holders
from viewer.export import perfetto_bulk as bulk
from viewer.export import wire
from viewer.export.perfetto_bulk import ARGS, REQUEST, REQUESTS, ROUNDS
from viewer.export.window import Window, table_in, windowed

BATCH = 25_000  # requests or rounds per column-wise batch
REQUEST_COLS = ["request_id", "arrival_ns", "tokenized_ns", "first_scheduled_ns", "first_token_ns", "finish_ns", "token_runs",
                "prompt_len", "output_len", "cached_prefix_len", "finish_reason", "num_preemptions"]
Flows = tuple[np.ndarray, np.ndarray]  # (round, flow id), sorted by round


def requests(trace: Trace, f: IO[bytes], names: dict[str, int], steps: pa.Table, stats: Any,
             pool: tuple[np.ndarray, np.ndarray, np.ndarray], timeline: pa.Table,
             window: Window | None = None) -> tuple[Flows, np.ndarray]:
    """An async track per request under `requests`, with its stages (`timeline`: the
    trace's `timeline_rows`); returns the flows,
    and which of the tokenizer pool's rows, (arrival, the thread's start, end) each, put
    their wait (arrival to the thread's start) on a request's track as `tokenize wait`:
    those whose arrival and end are a request's arrival_ns and tokenized_ns."""
    q = _requests(trace, window)
    n = q.num_rows
    pa_, ps, pe = pool
    who = _match(pa_, pe, q["arrival_ns"].to_numpy().astype(np.int64), q["tokenized_ns"].to_numpy().astype(np.int64))
    waited = (who >= 0) & (ps > pa_)
    w_req, w_a, w_s = who[waited], pa_[waited], ps[waited]
    chunks = _by_request(timeline, q["request_id"])
    a = q["arrival_ns"].to_numpy().astype(np.int64)
    fs, fin = q["first_scheduled_ns"].to_numpy(), np.maximum(a, q["finish_ns"].to_numpy())
    s = np.where(fs > 0, np.maximum(a, fs), fin)  # never scheduled (rejected, aborted waiting): queued to its end
    e = np.maximum(s, fin)
    ft = q["first_token_ns"].to_numpy()
    p_end = np.where(ft > 0, np.clip(ft, s, e), e)
    # flows: the rounds of its prefill chunks, and the round of its last token
    runs = q["token_runs"]
    length = pc.list_value_length(runs).fill_null(0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(runs).to_numpy(zero_copy_only=False)
    ends = np.cumsum(length)
    has = length >= 2
    last = np.where(has, flat[np.maximum(ends - 2, 0)] + flat[np.maximum(ends - 1, 0)] - 1, -1) if len(flat) else \
        np.full(n, -1)
    ck = chunks["stage"] == "prefill_chunk"
    req = np.concatenate([chunks["req"][ck], np.flatnonzero(has)])
    rnd = np.concatenate([chunks["step"][ck], last[has]])
    span = int(rnd.max()) + 2 if len(rnd) else 1
    key = np.sort(req.astype(np.int64) * span + (rnd.astype(np.int64) + 1))  # by request, then round
    once = np.ones(len(key), dtype=bool)
    once[1:] = key[1:] != key[:-1]
    key = key[once]  # each pair once (np.unique, which hashes, took 30x as long on 2 M pairs)
    req, rnd = key // span, key % span - 1
    if window is not None:  # a flow needs both ends: only to the window's rounds
        keep = np.isin(rnd, steps["step"].to_numpy())
        req, rnd = req[keep], rnd[keep]
    fid = np.arange(1, len(req) + 1, dtype=np.int64)
    counts = np.bincount(req, minlength=n)
    first = np.concatenate([[0], np.cumsum(counts)])
    uuid = REQUEST + np.arange(n, dtype=np.int64)
    bounds = _round_bounds(steps)
    for lo in range(0, n, BATCH):
        hi = min(n, lo + BATCH)
        sl = slice(lo, hi)
        f.write(bulk.named_tracks(uuid[sl], q["request_id"].slice(lo, hi - lo), REQUESTS))
        flows = wire.fixed64s(bulk.FLOW_OUT, counts[sl], fid[first[lo]:first[hi]])
        args = [x for c in ("prompt_len", "output_len", "cached_prefix_len", "num_preemptions")
                for x in bulk.int_arg(ARGS[c], q[c].to_numpy()[sl])]
        groups = [(a[sl], e[sl], uuid[sl], names["request"], [*args, flows]),
                  (a[sl], s[sl], uuid[sl], names["queued"], [])]
        m = (w_req >= lo) & (w_req < hi)
        groups.append((w_a[m], w_s[m], uuid[w_req[m]], names["tokenize wait"], []))
        m = p_end[sl] > s[sl]
        groups.append((s[sl][m], p_end[sl][m], uuid[sl][m], names["prefill"], []))
        m = e[sl] > p_end[sl]
        groups.append((p_end[sl][m], e[sl][m], uuid[sl][m], names["decode"], []))
        # a chunk: its round, inside the request's prefill slice and after its previous chunk
        c = ck & (chunks["req"] >= lo) & (chunks["req"] < hi)
        ci, cs, cv = chunks["req"][c], chunks["step"][c], chunks["value"][c]
        b0, b1 = bounds(cs)
        c0, c1 = np.maximum(b0, s[ci]), np.minimum(np.maximum(b1, b0), p_end[ci])
        order = np.lexsort((c0, ci))
        ci, cs, cv, c0, c1 = ci[order], cs[order], cv[order], c0[order], c1[order]
        prev = np.concatenate([[np.iinfo(np.int64).min], c1[:-1]])
        c0 = np.where(np.concatenate([[False], ci[1:] == ci[:-1]]), np.maximum(c0, prev), c0)
        ok = c1 > c0
        groups.append((c0[ok], c1[ok], uuid[ci[ok]], names["prefill chunk"],
                       [*bulk.int_arg(ARGS["round"], cs[ok]), *bulk.int_arg(ARGS["tokens"], cv[ok])]))
        f.write(bulk.slices(groups))
        f.write(bulk.instants(e[sl], uuid[sl], names["finished"],
                              bulk.str_arg(ARGS["finish_reason"], q["finish_reason"].slice(lo, hi - lo))))
        stats.packets += sum(2 * len(g[0]) for g in groups) + 2 * (hi - lo)
    pre = ~ck
    f.write(bulk.instants(chunks["ts"][pre], uuid[chunks["req"][pre]], names["preempted"],
                          bulk.int_arg(ARGS["computed_tokens"], chunks["value"][pre])))
    stats.requests, stats.flows = n, len(fid)
    order = np.argsort(rnd, kind="stable")
    return (rnd[order], fid[order]), waited


def _match(a1: np.ndarray, e1: np.ndarray, a2: np.ndarray, e2: np.ndarray) -> np.ndarray:
    """For each pair (a1, e1), the index of an equal pair (a2, e2), each used once; -1 for none."""
    n1 = len(a1)
    if not n1 or not len(a2):  # no pairs to match (an imported trace has no requests, no tokenizer pool)
        return np.full(n1, -1, dtype=np.int64)
    side = np.concatenate([np.zeros(n1, np.int64), np.ones(len(a2), np.int64)])
    a, e = np.concatenate([a1, a2]), np.concatenate([e1, e2])
    order = np.lexsort((side, e, a))  # equal pairs together, the first side's first
    sa, se, sd = a[order], e[order], side[order]
    new = np.concatenate([[True], (sa[1:] != sa[:-1]) | (se[1:] != se[:-1])])
    grp = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    ones = np.bincount(grp, weights=sd == 0, minlength=len(first)).astype(np.int64)  # first side's, per pair
    k = np.arange(len(order)) - first[grp] - np.where(sd == 1, ones[grp], 0)  # k-th of its side in its pair
    two = np.flatnonzero((sd == 1) & (k < ones[grp]))
    out = np.full(n1, -1, dtype=np.int64)
    out[order[first[grp[two]] + k[two]]] = order[two] - n1
    return out


def rounds(f: IO[bytes], steps: pa.Table, flows: Flows | None, names: dict[str, int], stats: Any) -> None:
    """A slice per round on rank 0's `rounds` track, ending the flows of its requests."""
    rnd, fid = flows if flows is not None else (np.empty(0, np.int64), np.empty(0, np.int64))
    step = steps["step"].to_numpy()
    ts = steps["ts_ns"].to_numpy()
    end = ts + np.maximum(steps["dur_ns"].to_numpy(), 0)
    order = np.argsort(step, kind="stable")
    for lo in range(0, len(order), BATCH):
        idx = order[lo:lo + BATCH]
        a, z = np.searchsorted(rnd, step[idx]), np.searchsorted(rnd, step[idx] + 1)
        ends = wire.fixed64s(bulk.FLOW_END, z - a, fid[a[0]:z[-1]])  # idx is never empty: lo < len(order)
        f.write(bulk.slices([(ts[idx], end[idx], np.full(len(idx), ROUNDS), names["round"],
                              [*bulk.int_arg(ARGS["round"], step[idx]), ends])]))
    stats.rounds = steps.num_rows
    stats.packets += 2 * steps.num_rows


def leak_counts(trace: Trace, window: Window | None = None) -> dict[str, int] | None:
    """Blocks still held at the end by each finished request, counted from every memory
    event of the run (viewer/analysis/holders.py; `mstrace leaks` names the blocks); None
    where the trace cannot say or the window does not hold the last round. It reads its
    own tables only, so the export runs it on a thread beside the probe rows."""
    if not (trace.has_table("memory") and trace.has_table("requests")) or \
            (window is not None and not window.holds_last_round):
        return None
    held: dict[str, int] = {}
    for part in trace.parts.get("memory", []):
        fold_holders(read_parts([part], TABLES["memory"], ["kind", "request_id"], ("kind", "request_id")), held)
    finished = set(trace.table("requests", ["request_id"])["request_id"].to_pylist())
    return {rid: n for rid, n in sorted(held.items()) if rid in finished}


def instants(trace: Trace, b: Any, names: dict[str, int], steps: pa.Table, stats: Any, leaks: dict[str, int] | None,
             window: Window | None = None) -> None:
    """Stalls (with their wait cycle) and leaked blocks (`leak_counts`), on rank 0's
    `rounds` track: few, so through the protobuf classes; in a window, its stalls."""
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent

    def put(t: int, name: str, args: dict[str, Any]) -> None:
        p = TracePacket(timestamp=t, trusted_packet_sequence_id=bulk.SEQ,
                        sequence_flags=TracePacket.SEQ_NEEDS_INCREMENTAL_STATE)
        e = p.track_event
        e.type, e.track_uuid, e.name_iid = TrackEvent.TYPE_INSTANT, ROUNDS, names[name]
        for k, v in args.items():
            if isinstance(v, int):
                e.debug_annotations.add(name=k, int_value=v)
            else:
                e.debug_annotations.add(name=k, string_value=v if isinstance(v, str) else str(v))
        b.write_packet(p)
        stats.packets += 1

    if trace.has_table("stalls"):
        for r in trace.table("stalls").to_pylist():
            if window is not None and not window.reaches(int(r["ts_ns"]), int(r["ts_ns"])):
                continue
            put(int(r["ts_ns"]), "stall", {k: r[k] for k in ("rank", "step", "waiter", "what", "signaller",
                                                             "boundary", "waited_ns", "cycle") if k in r})
    if leaks:
        end = int(pc.max(pc.add(steps["ts_ns"], steps["dur_ns"])).as_py() or 0) if steps.num_rows else 0
        for rid, n in leaks.items():
            put(end, "leaked blocks", {"request_id": rid, "blocks": n})


STAGES = ("prefill_chunk", "preempted")  # the timeline rows the requests' tracks show


def timeline_rows(trace: Trace, window: Window | None = None) -> pa.Table:
    """The timeline rows of `STAGES`, part by part (a long run's timeline is large). It
    reads its own table only, so the export runs it on a thread beside the probe rows."""
    keep: list[pa.Table] = []
    cols = ["ts_ns", "request_id", "stage", "step", "value"]
    parts = [] if not trace.has_table("timeline") else \
        (read_parts([p], TABLES["timeline"], cols) for p in trace.parts.get("timeline", [])) if window is None \
        else windowed(trace, "timeline", cols, window)
    for t in parts:
        keep.append(t.filter(pc.is_in(t["stage"].cast(pa.string()), pa.array(list(STAGES)))))
    return pa.concat_tables(keep) if keep else TABLES["timeline"].empty_table().select(cols)


def _by_request(t: pa.Table, ids: pa.ChunkedArray) -> dict[str, np.ndarray]:
    """`timeline_rows`' rows with each row's request as an index into `ids` (rows of no
    request in `ids` left out)."""
    req = pc.index_in(t["request_id"], value_set=ids.combine_chunks()).fill_null(-1).to_numpy().astype(np.int64)
    ok = req >= 0
    stage, names = codes(t["stage"])
    return {"req": req[ok], "ts": t["ts_ns"].to_numpy()[ok], "step": t["step"].to_numpy()[ok],
            "value": t["value"].to_numpy()[ok], "stage": np.asarray(names, dtype=object)[stage][ok]}


def _requests(trace: Trace, window: Window | None) -> pa.Table:
    q = table_in(trace, "requests", REQUEST_COLS, window)
    return q.filter(pc.equal(q["request_id"], window.request)) if window is not None and window.request is not None else q




def _round_bounds(steps: pa.Table) -> Any:
    """A function from an array of steps to their rounds' (start, end); (0, 0) for a step
    the trace has no round of."""
    step = steps["step"].to_numpy()
    order = np.argsort(step, kind="stable")
    ss, ts = step[order], steps["ts_ns"].to_numpy()[order]
    te = ts + np.maximum(steps["dur_ns"].to_numpy()[order], 0)

    def at(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not len(ss):
            return np.zeros(len(x), np.int64), np.zeros(len(x), np.int64)
        i = np.clip(np.searchsorted(ss, x), 0, len(ss) - 1)
        found = ss[i] == x
        return np.where(found, ts[i], 0), np.where(found, te[i], 0)

    return at
