"""The stall watchdog: finds waits that last too long and dumps why.

The remedy for deadlocks is a timeout
on every wait that, on expiry, dumps every stream's state, its recent kernels
and the call stack. Every engine wait goes through `probes.waits.timed_wait`,
which registers an `ActiveWait` while it lasts, so a separate thread can see
the stall *while it is still happening* (the stacks are only meaningful then)
and can also name the wait cycle: each active wait is an edge
"waiter --what--> signaller"; the engine adds resource edges (who holds the
blocks a waiter needs); a cycle in that graph is the deadlock.

Typical wiring (the watchdog thread is the producer that owns the buffer):

    buf = writer.buffer("stalls")
    wd = Watchdog(engine.registry, 2.0, on_stall=lambda r: buf.append(r.to_row()),
                  streams=lambda: [s.state() for s in engine.streams.values()])
    wd.start() ... wd.stop()

Probes never import the engine: everything engine-specific arrives through
callables.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from probes.clock import now_ns
from probes.waits import DEVICE_THREAD, ActiveWait, WaitRegistry

DEFAULT_INTERVAL_S = 0.1


@dataclass(slots=True)
class Edge:
    """`src` waits for `label`, which `dst` must signal or release."""

    src: str
    label: str
    dst: str


def wait_for_graph(waits: list[ActiveWait], extra: list[Edge]) -> list[Edge]:
    """One edge per active wait (waiter --what--> signaller), then the engine's extra edges."""
    return [Edge(w.waiter, w.what, w.signaller) for w in waits] + list(extra)


def find_cycle(edges: list[Edge], start: str | None = None) -> list[Edge] | None:
    """A cycle in the wait-for graph as its edges in order, or None.

    With `start` (the stalled waiter) only cycles reachable from it count, and
    one through it reads from its point of view: a wait that merely sits
    beside an unrelated deadlock is not "in" it (that deadlock's own waits get
    their own reports). Without `start`, every node is a root, in sorted order.
    Deterministic: each node's edges are followed in the order given.
    Iterative DFS with white/grey/black colouring: a grey node reached again
    closes a cycle.
    """
    adj: dict[str, list[Edge]] = {}
    for e in edges:
        adj.setdefault(e.src, []).append(e)
        adj.setdefault(e.dst, [])
    if start is not None:
        roots = [start] if start in adj else []
    else:
        roots = sorted(adj)
    done: set[str] = set()
    for root in roots:
        if root in done:
            continue
        path: list[Edge] = []  # the edges from root to the current node
        on_path: dict[str, int] = {root: 0}  # node -> index in path of the edge leaving it
        stack: list[tuple[str, int]] = [(root, 0)]  # (node, next edge index to try)
        while stack:
            node, i = stack[-1]
            if i >= len(adj[node]):
                stack.pop()
                done.add(node)
                del on_path[node]
                if path:
                    path.pop()
                continue
            stack[-1] = (node, i + 1)
            e = adj[node][i]
            if e.dst in on_path:
                return path[on_path[e.dst]:] + [e]
            if e.dst in done:
                continue
            on_path[e.dst] = len(path) + 1
            path.append(e)
            stack.append((e.dst, 0))
    return None


def name_cycle(cycle: list[Edge]) -> str:
    """`a -> what a waits for -> b -> ... -> a`; "" for no cycle."""
    if not cycle:
        return ""
    parts = [cycle[0].src]
    for e in cycle:
        parts += [e.label, e.dst]
    return " -> ".join(parts)


@dataclass(slots=True)
class ThreadStack:
    thread_id: int
    name: str
    frames: list[str]  # traceback.format_stack entries, outermost first

    def to_dict(self) -> dict[str, Any]:
        return {"thread_id": self.thread_id, "name": self.name, "frames": self.frames}


def thread_stacks(skip: int | None = None) -> list[ThreadStack]:
    """Every Python thread's current stack, named, sorted by name for a stable dump."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = [
        ThreadStack(tid, names.get(tid, f"thread-{tid}"), traceback.format_stack(frame))
        for tid, frame in sys._current_frames().items()
        if tid != skip
    ]
    out.sort(key=lambda s: (s.name, s.thread_id))
    return out


def _wait_dict(w: ActiveWait, now: int) -> dict[str, Any]:
    return {**asdict(w), "waited_ns": now - w.since_ns}


@dataclass(slots=True)
class _Scene:
    """What one watchdog pass saw, shared by its reports."""

    ts: int
    graph: list[Edge]
    streams: list[dict[str, Any]]
    stacks: list[ThreadStack]
    kv: dict[str, Any]
    step: int


@dataclass(slots=True)
class StallReport:
    ts_ns: int  # when the watchdog noticed
    rank: int
    step: int  # the engine's step when noticed; -1 when unknown
    wait: ActiveWait  # the wait that passed the timeout
    waited_ns: int
    waits: list[ActiveWait]  # every active wait at that moment
    graph: list[Edge]
    cycle: list[Edge] | None
    streams: list[dict[str, Any]] = field(default_factory=list)
    stacks: list[ThreadStack] = field(default_factory=list)
    kv: dict[str, Any] = field(default_factory=dict)

    @property
    def cycle_name(self) -> str:
        return name_cycle(self.cycle or [])

    def to_row(self) -> tuple[Any, ...]:
        """The `stalls` table row, in tracing.schema.STALLS column order."""
        w = self.wait
        return (
            self.ts_ns, self.rank, self.step, w.waiter, w.what, w.signaller, w.boundary,
            self.waited_ns, self.cycle_name,
            _json([asdict(e) for e in self.graph]),
            _json(self.streams),
            _json([s.to_dict() for s in self.stacks]),
            _json(self.kv),
            _json([_wait_dict(x, self.ts_ns) for x in self.waits]),
        )

    def render_summary(self) -> str:
        """What stderr gets at once: the wait, the cycle, the active waits (the streams, the
        KV pool and every thread's stack are in the trace's stalls table)."""
        return "\n".join(self._head() + [f"  ({len(self.stacks)} thread stacks, stream states and the KV pool "
                                          "are in the trace: mstrace stalls TRACE)"])

    def _head(self) -> list[str]:
        w = self.wait
        lines = [
            f"STALL rank {self.rank} step {self.step}: {w.waiter} has waited "
            f"{self.waited_ns / 1e9:.2f} s for {w.what} (to be signalled by {w.signaller}; boundary {w.boundary})",
            f"wait cycle: {self.cycle_name}" if self.cycle else "wait cycle: none (nobody signals it, or it is slow)",
            "active waits:",
        ]
        for x in sorted(self.waits, key=lambda x: x.since_ns):
            lines.append(f"  {x.waiter} -> {x.what} -> {x.signaller}  "
                         f"({(self.ts_ns - x.since_ns) / 1e9:.2f} s, "
                         f"{'thread ' + str(x.thread_id) if x.thread_id != DEVICE_THREAD else 'on the device'})")
        return lines

    def render_text(self) -> str:
        """A plain-text dump for logs: the wait, the cycle, waits, streams, KV, stacks."""
        lines = self._head()
        extra = self.graph[len(self.waits):]
        if extra:
            lines.append("resource edges:")
            lines += [f"  {e.src} -> {e.label} -> {e.dst}" for e in extra]
        lines.append("streams:")
        for s in self.streams:
            cur = s.get("in_progress")
            lines.append(f"  {s.get('stream', '?')}: queue depth {s.get('queue_depth')}, "
                         f"in progress {cur.get('label') if isinstance(cur, dict) else cur}, "
                         f"error {s.get('error')}")
            for op in list(s.get("recent") or [])[-8:]:
                label, step, t0, t1 = op
                lines.append(f"    {label} step {step}: {(t1 - t0) / 1e3:.0f} us, "
                             f"ended {(self.ts_ns - t1) / 1e6:.1f} ms ago")
        lines.append(f"kv: {_json(self.kv)}")
        for st in self.stacks:
            lines.append(f"thread {st.name} ({st.thread_id}):")
            lines += [ln for f in st.frames for ln in f.rstrip("\n").split("\n")]
        return "\n".join(lines)


def _json(obj: Any) -> str:
    # default=str: stream state or a KV summary may carry values JSON lacks (enums, paths).
    return json.dumps(obj, default=str, separators=(",", ":"))


def _guard(fn: Callable[[], Any], fallback: Any) -> Any:
    """Collect one part of a report; a failing collector must not lose the rest of the dump."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the dump is best effort by design
        return fallback(e)


class Watchdog:
    """A daemon thread that reports every wait lasting longer than `timeout_s`, once.

    `timeout_s` should be below the waits' own timeout (5 s by default), so the
    dump is taken while the stall is live and the stacks show it.
    """

    def __init__(
        self,
        registry: WaitRegistry,
        timeout_s: float,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        on_stall: Callable[[StallReport], None],
        streams: Callable[[], list[dict[str, Any]]] | None = None,
        kv_summary: Callable[[], dict[str, Any]] | None = None,
        extra_edges: Callable[[], list[Edge]] | None = None,
        rank: int = 0,
        step: Callable[[], int] | None = None,
        extra_stacks: Callable[[], list[ThreadStack]] | None = None,
    ) -> None:
        if timeout_s <= 0 or interval_s <= 0:
            raise ValueError(f"timeout_s and interval_s must be > 0, got {timeout_s}, {interval_s}")
        self.registry = registry
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.on_stall = on_stall
        self.streams = streams
        self.kv_summary = kv_summary
        self.extra_edges = extra_edges
        self.extra_stacks = extra_stacks  # threads outside this process (a CPU device process)
        self.rank = rank
        self.step = step
        self.stalls_reported = 0  # reports built so far (each wait at most once)
        # expired waits whose reports are being built (the device's stacks can take a second):
        # a wait that gave up meanwhile waits for them (scheduler/stall_guard.py)
        self.reporting = 0
        self.checks = 0
        self.busy_ns = 0  # time spent checking, so its own cost can be stated (and tested)
        self._timeout_ns = int(timeout_s * 1e9)
        # Reported waits by id(); holding the object keeps its id from being
        # reused by a later wait while the entry lives.
        self._fired: dict[int, ActiveWait] = {}
        # a wait that gives up checks on its own thread (timed_wait's on_expire) while this
        # thread may be checking too: one pass at a time, so no wait is reported twice
        self._checking = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="stall-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Watchdog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check(self) -> list[StallReport]:
        """One pass: report waits newly past the timeout. Cheap when nothing is stalled:
        one registry snapshot and one comparison per active wait."""
        with self._checking:
            return self._check()

    def _check(self) -> list[StallReport]:
        self.checks += 1
        waits = self.registry.snapshot()
        if not waits and not self._fired:
            return []
        limit = now_ns() - self._timeout_ns
        fired = self._fired
        expired = [w for w in waits if w.since_ns < limit and id(w) not in fired]
        if fired:
            # Forget waits that ended, so the dict stays as small as the live set.
            live = {id(w) for w in waits}
            for k in [k for k in fired if k not in live]:
                del fired[k]
        if not expired:
            return []
        # Everything below runs only when something has stalled: cost is irrelevant.
        reports = []
        # all counted at once, so the count never reads 0 between two of them; whatever ends
        # the loop early (a sink raising SystemExit) takes back what it did not build
        left = len(expired)
        self.reporting += left
        try:
            scene: _Scene | None = None
            for w in sorted(expired, key=lambda x: x.since_ns):
                fired[id(w)] = w
                try:
                    scene = scene or self._scene(waits)
                    rep = self._build(w, waits, scene)
                    reports.append(rep)
                    self.stalls_reported += 1
                    self.on_stall(rep)
                except Exception:  # noqa: BLE001 - a broken sink must not kill the watchdog
                    traceback.print_exc(file=sys.stderr)
                finally:
                    left -= 1
                    self.reporting -= 1
        finally:
            self.reporting -= left
        return reports

    def _scene(self, waits: list[ActiveWait]) -> _Scene:
        """What every report of one pass shows, gathered once (a device process's stacks take
        up to a second to ask for: once a pass, not once a stalled wait)."""
        extra: list[Edge] = (_guard(self.extra_edges, lambda e: [])
                             if self.extra_edges is not None else [])
        streams: list[dict[str, Any]] = (_guard(self.streams, lambda e: [{"error": repr(e)}])
                                         if self.streams is not None else [])
        kv: dict[str, Any] = (_guard(self.kv_summary, lambda e: {"error": repr(e)})
                              if self.kv_summary is not None else {})
        step: int = _guard(self.step, lambda e: -1) if self.step is not None else -1
        # The watchdog's own stack is just this reporting code: leave it out (a wait checking on
        # its own thread keeps its stack: it shows the wait)
        own = self._thread.ident if self._thread is not None else threading.get_ident()
        stacks = thread_stacks(skip=own)
        if self.extra_stacks is not None:
            stacks += _guard(self.extra_stacks, lambda e: [ThreadStack(-1, f"error: {e!r}", [])])
        return _Scene(now_ns(), wait_for_graph(waits, extra), streams, stacks, kv, step)

    def _build(self, w: ActiveWait, waits: list[ActiveWait], scene: _Scene) -> StallReport:
        cycle = find_cycle(scene.graph, start=w.waiter)
        return StallReport(scene.ts, self.rank, scene.step, w, scene.ts - w.since_ns, list(waits), scene.graph,
                           cycle, scene.streams, scene.stacks, scene.kv)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            t0 = now_ns()
            try:
                self.check()
            except Exception:  # noqa: BLE001 - keep watching; the next pass may succeed
                traceback.print_exc(file=sys.stderr)
            self.busy_ns += now_ns() - t0
