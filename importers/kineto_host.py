"""The scheduling thread of an imported trace: its rounds, its waits on the device, and the
host ranges mapped to boundaries, as non-overlapping probe rows.

Rounds are the iterations of a repeated range (`ProfilerStep#N` unless a preset or
`--round` says otherwise), on the thread that has them: that thread is the scheduling
thread, whose time the host view divides. Its waits on the device become
`scheduler_barrier` rows: the runtime's synchronous calls (CUDA and HIP names alike), a
`cudaEventQuery` polling loop as one wait, and `aten::item` / `aten::_local_scalar_dense`
where no runtime call inside shows the wait (a trace without CUDA activities). Each wait
names its caller: the innermost operator or annotation open around it. `--map` (and
mstrace's own `mstrace::<boundary>` ranges) turn annotations into boundaries. Nested rows
are cut so that the innermost one has each instant, as the native host view charges it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from importers.kineto_events import ANNOTATION, CPU_OP, RUNTIME, HostArrays, Names
from probes import boundaries as B

_RT = r"(cuda|hip|cu)"
SYNC_CALL = re.compile(rf"^{_RT}(StreamSynchronize|EventSynchronize|DeviceSynchronize|CtxSynchronize|Memcpy"
                       rf"|MemcpyWithStream|MemcpyDtoH|MemcpyDtoH_v2|Memcpy2D|Memset)$")
POLL_CALL = re.compile(rf"^{_RT}EventQuery$")
STREAM_WAIT_CALL = re.compile(rf"^{_RT}StreamWaitEvent$")
SYNC_OPS = re.compile(r"^aten::(item|_local_scalar_dense)$")
OWN_RANGE = re.compile(r"^mstrace::(\w+)$")  # `mstrace run --torch-profile`: every boundary also a range
# A gap this long between two polls ends a polling loop: the thread went on to other work.
POLL_GAP_NS = 50_000


@dataclass(slots=True)
class HostRows:
    """The scheduling thread's rows: probe rows (boundary names) and the waits with callers."""

    ts: list[int] = field(default_factory=list)
    dur: list[int] = field(default_factory=list)
    boundary: list[str] = field(default_factory=list)
    # the waits (scheduler_barrier and stream_wait rows), each with what it called and its caller
    waits: list[tuple[int, int, str, str]] = field(default_factory=list)


@dataclass(slots=True)
class Rounds:
    ts: np.ndarray
    end: np.ndarray
    step: np.ndarray
    label: list[str]

    def step_of(self, t: np.ndarray) -> np.ndarray:
        """The round each time falls in (from its start to the next round's start; -1 outside)."""
        if not len(self.ts):
            return np.full(len(t), -1, np.int64)
        i = np.searchsorted(self.ts, t, side="right") - 1
        ok = (i >= 0) & ~((i == len(self.ts) - 1) & (t >= self.end[-1]))
        return np.where(ok, self.step[np.maximum(i, 0)], -1)


def scheduling_thread(h: HostArrays, round_names: np.ndarray) -> int:
    """The thread with the round ranges; without any, the one that launched the most."""
    for mask in (np.isin(h.name, round_names), h.cat == RUNTIME, np.ones(len(h.tid), bool)):
        if mask.any():
            return int(np.bincount(h.tid[mask]).argmax())
    return -1


def find_rounds(h: HostArrays, names: Names, pattern: re.Pattern[str], tid: int) -> Rounds:
    """The matching ranges on `tid`, outermost only; step = the first number in the name
    (ProfilerStep#N) when every round has a distinct one, else the round's index."""
    ids = np.array([i for i, n in enumerate(names.names) if pattern.search(n)], np.int32)
    m = (h.tid == tid) & np.isin(h.name, ids) & (h.cat != RUNTIME)
    ts, end, nm = h.ts[m], h.end[m], h.name[m]
    o = np.lexsort((-end, ts))
    ts, end, nm = ts[o], end[o], nm[o]
    keep = np.ones(len(ts), bool)
    last_end = np.iinfo(np.int64).min
    for k in range(len(ts)):  # rounds are few: one per scheduling step
        if ts[k] < last_end:
            keep[k] = False
        else:
            last_end = end[k]
    ts, end, nm = ts[keep], end[keep], nm[keep]
    labels = [names.names[i] for i in nm]
    nums = [re.search(r"#\s*(\d+)", s) for s in labels]
    if labels and all(nums) and len({int(x.group(1)) for x in nums if x}) == len(labels):
        step = np.array([int(x.group(1)) for x in nums if x], np.int64)
    else:
        step = np.arange(len(labels), dtype=np.int64)
    return Rounds(ts, end, step, labels)


def host_rows(h: HostArrays, names: Names, tid: int, maps: list[tuple[str, re.Pattern[str]]]) -> HostRows:
    """The scheduling thread's probe rows (see the module's docstring)."""
    m = h.tid == tid
    ts, end, nm, cat = h.ts[m], h.end[m], h.name[m], h.cat[m]
    o = np.lexsort((-end, ts))
    ts, end, nm, cat = ts[o], end[o], nm[o], cat[o]
    label = _labels(names, maps)  # name id -> boundary for mapped ranges
    kind = _kinds(names)  # name id -> "sync" | "poll" | "wait" | "op_sync" | ""
    spans: list[tuple[int, int, str]] = []  # (start, end, boundary) before the cut
    out = HostRows()
    stack: list[list[int]] = []  # open ranges: [end, name id, cat, has a runtime call inside, start]
    poll: list[int] | None = None  # [start, end, caller name id] of the polling loop in progress

    def close_poll() -> None:
        nonlocal poll
        if poll is not None:
            spans.append((poll[0], poll[1], B.SCHEDULER_BARRIER))
            out.waits.append((poll[0], poll[1] - poll[0], "cudaEventQuery (polling loop)", _name(names, poll[2])))
            poll = None

    for k in range(len(ts)):
        s, e, n, c = int(ts[k]), int(end[k]), int(nm[k]), int(cat[k])
        while stack and stack[-1][0] <= s:
            _pop(stack, spans, out, names, kind)
        caller = next((x[1] for x in reversed(stack) if x[2] in (CPU_OP, ANNOTATION)), -1)
        if c == RUNTIME:
            for x in stack:
                x[3] = 1
            kd = kind.get(n, "")
            if kd == "poll":
                if poll is not None and s - poll[1] <= POLL_GAP_NS and poll[2] == caller:
                    poll[1] = max(poll[1], e)
                else:
                    close_poll()
                    poll = [s, e, caller]
                continue
            if kd == "sync":
                close_poll()
                spans.append((s, e, B.SCHEDULER_BARRIER))
                out.waits.append((s, e - s, names.names[n], _name(names, caller)))
            elif kd == "wait":
                out.waits.append((s, e - s, names.names[n], _name(names, caller)))
            continue
        if poll is not None and s - poll[1] > POLL_GAP_NS:
            close_poll()
        b = label.get(n)
        if b is not None:
            spans.append((s, e, b))
        stack.append([e, n, c, 0, s])
    while stack:
        _pop(stack, spans, out, names, kind)
    close_poll()
    _cut(spans, out)
    return out


def _pop(stack: list[list[int]], spans: list[tuple[int, int, str]], out: HostRows, names: Names,
         kind: dict[int, str]) -> None:
    """Close the innermost open range. A sync op with no runtime call inside (a trace without
    CUDA activities) is the wait itself; aten::item's own _local_scalar_dense is not a second one."""
    e, n, c, has_rt, s = stack.pop()
    if c != CPU_OP or has_rt or kind.get(n) != "op_sync" or (stack and kind.get(stack[-1][1]) == "op_sync"):
        return
    caller = next((x[1] for x in reversed(stack) if x[2] in (CPU_OP, ANNOTATION)), -1)
    spans.append((s, e, B.SCHEDULER_BARRIER))
    out.waits.append((s, e - s, names.names[n], _name(names, caller)))


def _cut(spans: list[tuple[int, int, str]], out: HostRows) -> None:
    """Rows that nest are cut so each instant belongs to the innermost one."""
    for a, b, lab in innermost(spans):
        out.ts.append(a)
        out.dur.append(b - a)
        out.boundary.append(lab)


def innermost(spans: list[tuple[int, int, Any]]) -> list[tuple[int, int, Any]]:
    """Nested intervals as disjoint segments, each instant the innermost interval's label."""
    spans.sort(key=lambda x: (x[0], -x[1]))
    out: list[tuple[int, int, Any]] = []
    stack: list[tuple[int, Any]] = []
    pos = 0
    for s, e, lab in spans:
        while stack and stack[-1][0] <= s:
            end, top = stack.pop()
            if end > pos:
                out.append((pos, end, top))
            pos = max(pos, end)
        if stack:
            if s > pos:
                out.append((pos, s, stack[-1][1]))
            e = min(e, stack[-1][0])  # a row never outlives the one it sits in
        stack.append((e, lab))
        pos = s
    while stack:
        end, top = stack.pop()
        if end > pos:
            out.append((pos, end, top))
        pos = max(pos, end)
    return out


def idle_by_range(h: HostArrays, names: Names, tid: int, busy_s: np.ndarray, busy_e: np.ndarray, lo: int,
                  hi: int) -> tuple[dict[str, int], int]:
    """The device's idle time in [lo, hi) charged to the scheduling thread's innermost open
    operator or annotation at each instant; and the idle time no range covered."""
    from viewer.analysis.intervals import Coverage

    m = (h.tid == tid) & (h.cat != RUNTIME) & (h.end > lo) & (h.ts < hi)
    segs = innermost([(max(int(a), lo), min(int(b), hi), int(n))
                      for a, b, n in zip(h.ts[m].tolist(), h.end[m].tolist(), h.name[m].tolist(), strict=True)])
    busy = Coverage(busy_s, busy_e)
    total_idle = (hi - lo) - int(busy.covered(np.array([lo]), np.array([hi]))[0])
    if not segs:
        return {}, total_idle
    a = np.array([x[0] for x in segs], np.int64)
    b = np.array([x[1] for x in segs], np.int64)
    idle = (b - a) - busy.covered(a, b)
    by = np.bincount(np.array([x[2] for x in segs], np.int64), weights=idle, minlength=len(names.names))
    out = {names.names[i]: int(v) for i, v in enumerate(by) if v > 0}
    return out, total_idle - int(idle.sum())


def _labels(names: Names, maps: list[tuple[str, re.Pattern[str]]]) -> dict[int, str]:
    out: dict[int, str] = {}
    for i, n in enumerate(names.names):
        own = OWN_RANGE.match(n)
        if own and own.group(1) in B.ALL:
            out[i] = own.group(1)
            continue
        for boundary, pat in maps:
            if pat.search(n):
                out[i] = boundary
                break
    return out


def _kinds(names: Names) -> dict[int, str]:
    out: dict[int, str] = {}
    for i, n in enumerate(names.names):
        if SYNC_CALL.match(n):
            out[i] = "sync"
        elif POLL_CALL.match(n):
            out[i] = "poll"
        elif STREAM_WAIT_CALL.match(n):
            out[i] = "wait"
        elif SYNC_OPS.match(n):
            out[i] = "op_sync"
    return out


def _name(names: Names, i: int) -> str:
    return names.names[i] if i >= 0 else ""
