"""What a live view shows, kept up to date from a trace's new rows (viewer/live/tail.py).

`LiveState.update(poll)` folds one poll in; `snapshot()` returns a `TopView`, plain
data that the TUI renders and tests check. Everything here is windowed: the last
`lane_s` seconds of probe rows, the last `rounds` rounds for the cost table, the
requests that finished in the last `latency_s` seconds. So the work per refresh
follows the new rows, not the run's length. The cost table is the report's own
`cost_table`, run on the window's rounds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from probes import boundaries as B
from tracing.run_status import RunStatus
from viewer.analysis.advice import backend
from viewer.analysis.cost import CostTable, cost_table
from viewer.analysis.cycle_views import codes
from viewer.analysis.holders import fold_holders
from viewer.live.tail import Poll

STREAM_ORDER = ("main", "prefill", "comm", "host", "sender", "tokenizer", "http")
# Rows not yet whole: a round's response_send row can reach the trace a flush after the round.
HOLD = 2
# A finished request still holding blocks this long after its end is a suspected leak
# (the KV fence frees a finished request's blocks a round or two late).
LEAK_GRACE_NS = 1_000_000_000
_FINISHED_KEEP = 100_000  # finished ids remembered for the leak check


@dataclass(slots=True)
class Lane:
    rank: int
    stream: str
    start: np.ndarray  # ns, sorted
    end: np.ndarray
    boundary: list[str]  # per row
    step: np.ndarray
    current: str  # the newest row's boundary ("" when the lane has none in the window)
    busy: bool  # the newest row reaches the window's end: the op in progress

    @property
    def name(self) -> str:
        return f"r{self.rank} {self.stream}"

    def cells(self, t0: int, t1: int, width: int) -> list[str]:
        """The boundary that holds each of `width` columns over [t0, t1] ("" for none),
        by four samples per column; a row nested in another wins where it runs."""
        if width <= 0 or not len(self.start) or t1 <= t0:
            return [""] * max(0, width)
        k = 4
        s = t0 + (np.arange(width * k) + 0.5) * ((t1 - t0) / (width * k))
        i = np.searchsorted(self.start, s, side="right") - 1
        hit = (i >= 0) & (self.end[np.maximum(i, 0)] > s)
        missed = np.flatnonzero((i >= 0) & ~hit)
        if len(missed):  # past the end of a nested row: the innermost row around it still open
            parent = self._parents()
            for j in missed.tolist():
                r = parent[i[j]]
                while r >= 0 and self.end[r] <= s[j]:
                    r = parent[r]
                if r >= 0:
                    i[j], hit[j] = r, True
        out: list[str] = []
        for c in range(width):
            got = [self.boundary[i[j]] for j in range(c * k, c * k + k) if hit[j]]
            # a tie goes to the earlier sample: a set's order changes with the hash seed
            out.append(max(got, key=lambda b: (got.count(b), -got.index(b))) if got else "")
        return out


    def _parents(self) -> list[int]:
        """Per row, the row it started inside (the latest-starting one still open), -1 for none."""
        out: list[int] = [-1] * len(self.start)
        open_: list[int] = []
        for r, (a, z) in enumerate(zip(self.start.tolist(), self.end.tolist(), strict=True)):
            while open_ and self.end[open_[-1]] <= a:
                open_.pop()
            out[r] = open_[-1] if open_ else -1
            if z > a:
                open_.append(r)
        return out


@dataclass(slots=True)
class Latency:
    name: str
    p50_ms: float | None
    p99_ms: float | None
    series: list[float]  # newest last, for a sparkline


@dataclass(slots=True)
class KvView:
    capacity: int
    used: int
    free: int
    fenced: int
    largest_free_run: int | None  # None: the block table is not known (no snapshot yet)
    prefix_hit_rate: float | None
    holders: list[tuple[str, int]]  # (request id, blocks), most first
    exact: bool  # every event since a known state: the trace's start or a snapshot (else: since attaching)


@dataclass(slots=True)
class TopView:
    model: str
    mode: str
    backend: str
    status: RunStatus
    uptime_s: float
    req_per_s: float
    decode_tok_per_s: float
    running: int
    waiting: int
    finished: int
    last_step: int
    t0_ns: int  # the lanes' window
    t1_ns: int
    lanes: list[Lane] = field(default_factory=list)
    cost: CostTable | None = None
    cost_rounds: int = 0
    worst: str | None = None  # the costliest boundary other than the device's compute
    latency: list[Latency] = field(default_factory=list)
    kv: KvView | None = None
    stalls: list[dict[str, Any]] = field(default_factory=list)
    leaks: list[tuple[str, int]] = field(default_factory=list)  # (request id, blocks still held)


class LiveState:
    def __init__(self, lane_s: float = 2.0, rounds: int = 64, latency_s: float = 10.0, rate_s: float = 10.0,
                 keep_s: float = 0.0) -> None:
        """`keep_s`: probe rows kept beyond the lane window, so zooming out shows what was
        read (a finished run's last 30 s), not only what came after the zoom."""
        self.lane_s, self.rounds, self.latency_s, self.rate_s = lane_s, rounds, latency_s, rate_s
        self.keep_s = keep_s
        self.meta: dict[str, Any] = {}
        self.status: RunStatus | None = None
        self.committed: dict[str, int] = {}
        self._probes: pa.Table | None = None
        self._steps: pa.Table | None = None
        self._first_ns: int | None = None  # the first round seen: the steps kept are trimmed
        self._requests: pa.Table | None = None
        self._held: dict[str, int] = {}  # request id -> blocks it holds a reference to
        self._busy = np.zeros(0, dtype=bool)  # per block: some request holds it
        self._busy_known = True  # False: attached at a snapshot that did not list every held block
        self._exact = False
        self._finished: OrderedDict[str, int] = OrderedDict()  # request id -> finish_ns
        self.stalls: list[dict[str, Any]] = []
        self.rows_seen = 0
        self._now = 0  # the newest end of any row: rows only add, so a running max is exact
        self._version = 0  # bumped by every poll that brought rows: a snapshot of the same is reused
        self._snap: tuple[tuple[Any, ...], TopView] | None = None

    # ---- folding polls in ---------------------------------------------------
    def update(self, poll: Poll) -> None:
        if poll.new_rows or poll.status != self.status:
            self._version += 1
        self.meta, self.status, self.committed = poll.meta, poll.status, poll.committed
        self.rows_seen += poll.new_rows
        r = poll.rows
        for name in ("steps", "probes"):
            if name in r and r[name].num_rows:
                end = pc.max(pc.add(r[name]["ts_ns"], r[name]["dur_ns"])).as_py()
                self._now = max(self._now, int(end or 0))
        if "steps" in r and r["steps"].num_rows:
            if self._first_ns is None:
                self._first_ns = int(pc.min(r["steps"]["ts_ns"]).as_py())
            self._steps = _keep_last(_cat(self._steps, r["steps"]), max(4 * self.rounds, 4096))
        now = self._now
        if "probes" in r and r["probes"].num_rows:
            self._probes = _cat(self._probes, r["probes"])
        if self._probes is not None:
            keep_from = now - int(max(self.lane_s, self.keep_s) * 1e9)
            if self._steps is not None and self._steps.num_rows:
                first = self._steps["ts_ns"][max(0, self._steps.num_rows - self.rounds - HOLD - 1)].as_py()
                keep_from = min(keep_from, first)
            self._probes = self._probes.filter(pc.greater_equal(pc.add(self._probes["ts_ns"],
                                                                         self._probes["dur_ns"]), keep_from))
        if "requests" in r and r["requests"].num_rows:
            self._requests = _cat(self._requests, r["requests"])
            for rid, fin in zip(r["requests"]["request_id"].to_pylist(), r["requests"]["finish_ns"].to_pylist(),
                                strict=True):
                self._finished[rid] = fin
            while len(self._finished) > _FINISHED_KEEP:
                self._finished.popitem(last=False)
        if self._requests is not None:
            horizon = now - int(max(self.latency_s, self.rate_s) * 1e9)
            self._requests = self._requests.filter(pc.greater_equal(self._requests["finish_ns"], horizon))
        if "memory" in r and r["memory"].num_rows:
            self._replay(r["memory"], poll.skipped.get("memory", 0) > 0)
        if "stalls" in r and r["stalls"].num_rows:
            self.stalls.extend(r["stalls"].to_pylist())

    def _replay(self, mem: pa.Table, skipped: bool) -> None:
        """Fold memory events in: the holders' counts (viewer/analysis/holders.py), and
        which blocks are busy (each event's ref_count is its block's count after it, so
        a block is busy when its last event left it above zero)."""
        # a snapshot is a place to start only for a tail that attached mid-run; after that
        # every event arrives, and a snapshot would forget blocks whose holder died
        free_then = _last_snapshot_free(mem) if skipped and not self._exact else None
        mem, restarted = fold_holders(mem, self._held, restart=skipped and not self._exact)
        if restarted:  # the running requests' block tables followed
            self._busy[:] = False
        self._exact = self._exact or restarted or not skipped  # every event since a known state
        if not mem.num_rows:
            return
        bid = mem["block_id"].to_numpy()
        ref = mem["ref_count"].to_numpy()
        ok = bid >= 0
        bid, ref = bid[ok], ref[ok]
        if len(bid):
            if int(bid.max()) >= len(self._busy):
                self._busy = np.concatenate([self._busy, np.zeros(int(bid.max()) + 1 - len(self._busy), dtype=bool)])
            blocks, last = np.unique(bid[::-1], return_index=True)
            self._busy[blocks] = ref[::-1][last] > 0
        if restarted:
            # the listing names the running requests' blocks only: a leaked block, or one
            # behind the KV fence, is held though not listed. Then where the free blocks lie
            # is not known (they counted as free: a free run longer than the free count)
            # (the listing's own blocks: the poll's later events move both sides of the sum)
            cap = int((self.meta.get("model") or {}).get("kv_blocks") or 0)
            snap = mem.filter(pc.equal(mem["kind"], "snapshot").fill_null(False))["block_id"]
            listed = len(pc.unique(snap.filter(pc.greater_equal(snap, 0))))
            self._busy_known = not cap or free_then is None or listed + free_then == cap

    def round_rows(self, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A round still in the window: its steps row ({} once gone) and its probe rows."""
        p, s = self._probes, self._steps
        rows = p.filter(pc.equal(p["step"], step)).to_pylist() if p is not None and p.num_rows else []
        got = s.filter(pc.equal(s["step"], step)).to_pylist() if s is not None and s.num_rows else []
        return (got[0] if got else {}), rows

    def now_ns(self) -> int:
        """The newest time the trace has reached (the trace's clock, so a trace copied from
        another machine plays back as it was written)."""
        return self._now

    # ---- what to show ---------------------------------------------------------
    def snapshot(self) -> TopView:
        key = (self._version, self.lane_s, self.rounds, self.latency_s, self.rate_s)
        if self._snap is not None and self._snap[0] == key:
            return self._snap[1]
        v = self._build()
        self._snap = (key, v)
        return v

    def _build(self) -> TopView:
        meta = self.meta
        cfg = meta.get("config", {})
        now = self.now_ns()
        t0 = now - int(self.lane_s * 1e9)
        steps = self._steps
        last = steps.slice(steps.num_rows - 1).to_pylist()[0] if steps is not None and steps.num_rows else {}
        start = int((meta.get("clock") or {}).get("anchor_monotonic_ns") or 0)
        v = TopView(
            model=str((meta.get("model") or {}).get("name") or cfg.get("model", "?")),
            mode=str(cfg.get("mode", "?")),
            backend=backend(meta, None).name if meta else "?",
            status=self.status or RunStatus("truncated"),
            uptime_s=max(0.0, (now - start) / 1e9) if start and now else 0.0,
            req_per_s=self._rate_requests(now),
            decode_tok_per_s=self._rate_tokens(now),
            running=int(last.get("num_running", 0)),
            waiting=int(last.get("num_waiting", 0)),
            finished=self.committed.get("requests", 0),
            last_step=int(last.get("step", -1)),
            t0_ns=t0,
            t1_ns=now,
        )
        v.lanes = self._lanes(t0)
        v.cost, v.cost_rounds = self._cost()
        if v.cost is not None:
            others = [b for b in v.cost.boundaries if b.share is not None and b.boundary != B.DEVICE_COMPUTE]
            v.worst = max(others, key=lambda b: b.share or 0.0).boundary if others else None
        v.latency = self._latency()
        v.kv = self._kv(last)
        v.stalls = list(self.stalls)
        v.leaks = self._leaks(now)
        return v

    def _lanes(self, t0: int) -> list[Lane]:
        p = self._probes
        if p is None or not p.num_rows:
            return []
        p = p.filter(pc.greater(pc.add(p["ts_ns"], p["dur_ns"]), t0))
        if not p.num_rows:
            return []
        # grouped on the dictionaries' codes: a string per row cost more than the rest
        bnd_code, bnd_names = codes(p["boundary"])
        st_code, st_names = codes(p["stream"])
        keep = bnd_code != (bnd_names.index(B.IDLE) if B.IDLE in bnd_names else -1)
        ts, dur = p["ts_ns"].to_numpy()[keep], p["dur_ns"].to_numpy()[keep]
        rank, step = p["rank"].to_numpy()[keep], p["step"].to_numpy()[keep]
        bnd_code, st_code = bnd_code[keep], st_code[keep]
        if not len(ts):
            return []
        names = np.array(bnd_names, dtype=object)
        key = rank.astype(np.int64) * (len(st_names) + 1) + st_code
        groups = [(int(rank[i]), st_names[st_code[i]], k) for k, i in zip(*np.unique(key, return_index=True),
                                                                             strict=True)]
        groups.sort(key=lambda g: (g[0], STREAM_ORDER.index(g[1]) if g[1] in STREAM_ORDER else 99, g[1]))
        lanes = []
        t1 = self._now
        for r, s, k in groups:
            idx = np.flatnonzero(key == k)
            idx = idx[np.argsort(ts[idx], kind="stable")]
            st, en = ts[idx], ts[idx] + dur[idx]
            newest = int(idx[np.argmax(en)])
            lanes.append(Lane(r, s, st, en, names[bnd_code[idx]].tolist(), step[idx], bnd_names[bnd_code[newest]],
                              bool(ts[newest] + dur[newest] >= t1)))
        return lanes

    def _window_steps(self) -> pa.Table | None:
        s = self._steps
        if s is None or s.num_rows <= HOLD:
            return None
        n = s.num_rows - HOLD
        return s.slice(max(0, n - self.rounds), min(self.rounds, n))

    def _cost(self) -> tuple[CostTable | None, int]:
        s = self._window_steps()
        p = self._probes
        if s is None or p is None:
            return None, 0
        lo = int(s["ts_ns"][0].as_py())
        nxt = self._steps.slice(self._steps.num_rows - HOLD, 1)  # type: ignore[union-attr]
        hi = int(nxt["ts_ns"][0].as_py())
        win = p.filter(pc.and_(pc.greater_equal(p["ts_ns"], lo), pc.less(p["ts_ns"], hi)))
        return cost_table(win, s), s.num_rows

    def _latency(self) -> list[Latency]:
        q = self._requests
        if q is None or not q.num_rows:
            return [Latency(n, None, None, []) for n in ("TTFT", "ITL", "E2E")]
        fin = q["finish_ns"].to_numpy()
        inside = fin >= self._now - int(self.latency_s * 1e9)
        if not inside.all():  # update() already keeps only the longer of this and the rate window
            q, fin = q.filter(pa.array(inside)), fin[inside]
        order = np.argsort(fin, kind="stable")  # the sparklines run oldest to newest
        arr = q["arrival_ns"].to_numpy()[order]
        ft = q["first_token_ns"].to_numpy()[order]
        served = ft > 0  # E2E over the requests served, as the report's (serving.RequestTimes)
        ttft = ((ft - arr)[served]) / 1e6
        e2e = (fin[order] - arr)[served] / 1e6
        itl = pc.list_flatten(q["dur_itl_ns"]).to_numpy(zero_copy_only=False) / 1e6
        newest = q["dur_itl_ns"].take(pa.array(order[-60:]))
        recent = pc.list_flatten(newest).to_numpy(zero_copy_only=False)[-60:] / 1e6
        return [_lat("TTFT", ttft), _lat("ITL", itl, recent), _lat("E2E", e2e)]

    def _rate_requests(self, now: int) -> float:
        q = self._requests
        if q is None or not q.num_rows or not now:
            return 0.0
        lo = now - int(self.rate_s * 1e9)
        n = pc.sum(pc.greater_equal(q["finish_ns"], lo)).as_py() or 0
        return float(n) / self._span(now, self._first_ns)

    def _rate_tokens(self, now: int) -> float:
        s = self._steps
        if s is None or not s.num_rows or not now:
            return 0.0
        lo = now - int(self.rate_s * 1e9)
        got = s.filter(pc.greater_equal(s["ts_ns"], lo))
        # over the rounds kept: past 4,096 rounds in the window they cover less of it
        return float(pc.sum(got["num_decode_tokens"]).as_py() or 0) / self._span(now, int(s["ts_ns"][0].as_py()))

    def _span(self, now: int, first: int | None) -> float:
        """The rate window, shorter while what it counts (the run, or the rounds kept) is younger."""
        return max(1e-3, min(self.rate_s, (now - (now if first is None else first)) / 1e9))

    def _kv(self, last: dict[str, Any]) -> KvView | None:
        if not last:
            return None
        cap = int((self.meta.get("model") or {}).get("kv_blocks") or 0) or int(last["blocks_used"] + last["blocks_free"])
        run: int | None = None
        if self._exact and self._busy_known:
            busy = np.zeros(cap, dtype=bool)
            n = min(cap, len(self._busy))
            busy[:n] = self._busy[:n]
            free = np.flatnonzero(~busy)
            if len(free):
                breaks = np.flatnonzero(np.diff(free) != 1)
                lengths = np.diff(np.concatenate(([0], breaks + 1, [len(free)])))
                run = int(lengths.max())
            else:
                run = 0
        q = self._requests
        hit = None
        if q is not None and q.num_rows:
            prompt = pc.sum(q["prompt_len"]).as_py() or 0
            hit = (pc.sum(q["cached_prefix_len"]).as_py() or 0) / prompt if prompt else None
        holders = sorted(self._held.items(), key=lambda x: -x[1])[:8]
        return KvView(cap, int(last["blocks_used"]), int(last["blocks_free"]), int(last.get("blocks_fenced") or 0),
                      run, hit, holders, self._exact)

    def _leaks(self, now: int) -> list[tuple[str, int]]:
        ended = self.status is not None and not (self.status.state == "truncated" and self.status.live)
        out = []
        for rid, held in self._held.items():
            fin = self._finished.get(rid)
            if fin is not None and (ended or now - fin > LEAK_GRACE_NS):
                out.append((rid, held))
        return sorted(out, key=lambda x: -x[1])


def _lat(name: str, x: np.ndarray, series: np.ndarray | None = None) -> Latency:
    if not len(x):
        return Latency(name, None, None, [])
    p50, p99 = np.percentile(x, [50, 99])
    return Latency(name, float(p50), float(p99), [float(v) for v in (x if series is None else series)[-60:]])


def _cat(a: pa.Table | None, b: pa.Table) -> pa.Table:
    if a is None or not a.num_rows:
        return b
    t = pa.concat_tables([a, b], promote_options="permissive").unify_dictionaries()
    # a chunk per poll would pile up (the window's filter keeps them, emptied)
    return t.combine_chunks() if t.column(0).num_chunks > 16 else t


def _last_snapshot_free(mem: pa.Table) -> int | None:
    """The free count the last block-table snapshot in `mem` recorded (its marker's
    ref_count), None without one."""
    begin = np.flatnonzero(pc.equal(mem["kind"], "snapshot_begin").fill_null(False).to_numpy(zero_copy_only=False))
    return int(mem["ref_count"][int(begin[-1])].as_py()) if len(begin) else None


def _keep_last(t: pa.Table, n: int) -> pa.Table:
    return t.slice(t.num_rows - n) if t.num_rows > n else t
