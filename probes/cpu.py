"""CPU time of a run, read from the kernel's CPU clocks (never on the hot path).

`mstrace run` samples these clocks once before its workload starts and once after
it ends, and writes the difference into meta.json's end-of-run record (`run.cpu`).
That is the denominator of the probes' CPU share (bench/bench_probe_cpu.py): wall
time cannot resolve a cost of 1% on a shared machine, CPU time can.

Three readings, each for a reason:
  * this process, all threads (time.process_time_ns: CLOCK_PROCESS_CPUTIME_ID);
  * each live descendant process (the CPU device process, the TP/PP ranks started
    with subprocess.Popen, their children) from /proc/<pid>/stat: a child's CPU reaches getrusage(RUSAGE_CHILDREN) only once it
    is reaped, i.e. after the run, together with its model load;
  * each live thread of this process (its pthread CPU clock), so a report can say
    which thread spent the time (the scheduling thread, the writer, the sender ...),
    and its context switches (/proc): a thread that hands the GIL back and forth
    pays for it in CPU time that no per-row cost shows.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

_TICK_NS = 1_000_000_000 // (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


@dataclass(slots=True)
class CpuSample:
    process_ns: int  # this process, all threads
    children_ns: dict[int, int] = field(default_factory=dict)  # pid -> user + system CPU
    threads_ns: dict[str, int] = field(default_factory=dict)  # thread name -> its CPU clock
    threads_switches: dict[str, int] = field(default_factory=dict)  # thread name -> context switches so far


def child_cpu_ns(pid: int) -> int | None:
    """User + system CPU of process `pid` (10 ms ticks), or None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = stat[stat.rindex(b")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) * _TICK_NS  # fields 14 (utime) and 15 (stime)


def _switches(native_id: int | None) -> int | None:
    """Voluntary + involuntary context switches of one thread of this process."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/status", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    return sum(int(ln.split()[1]) for ln in lines
               if ln.split(b":")[0] in (b"voluntary_ctxt_switches", b"nonvoluntary_ctxt_switches"))


def thread_cpu_ns() -> tuple[dict[str, int], dict[str, int]]:
    """CPU clock and context switches of every live Python thread of this process, by name."""
    cpu: dict[str, int] = {}
    switches: dict[str, int] = {}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            ns = time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
        except (OSError, AttributeError, OverflowError):  # exited meanwhile, or no pthread clocks here
            continue
        name, k = t.name, 1
        while name in cpu:  # two threads may share a name
            k += 1
            name = f"{t.name}#{k}"
        cpu[name] = ns
        if (n := _switches(t.native_id)) is not None:
            switches[name] = n
    return cpu, switches


def descendants(pid: int | None = None) -> list[int]:
    """Every live process below `pid` (this one by default), however it was started:
    multiprocessing, subprocess.Popen (TP/PP ranks), their own children. From /proc's
    parent links; where there is no /proc, multiprocessing's children only."""
    root = os.getpid() if pid is None else pid
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return [p.pid for p in multiprocessing.active_children() if p.pid is not None]
    parent: dict[int, list[int]] = {}
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # it ended while we looked
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # field 4
        parent.setdefault(ppid, []).append(p)
    out, todo = [], list(parent.get(root, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parent.get(p, [])
    return out


def sample_cpu() -> CpuSample:
    children = {pid: ns for pid in descendants() if (ns := child_cpu_ns(pid)) is not None}
    return CpuSample(time.process_time_ns(), children, *thread_cpu_ns())


def cpu_record(start: CpuSample, end: CpuSample) -> dict[str, Any]:
    """meta.json `run.cpu`: the CPU time spent between two samples.

    A child or thread that started after `start` counts from zero (its clock starts at
    its creation); one that ended before `end` is lost, so `children_ns` and the
    per-thread figures are lower bounds and `process_ns` is exact."""
    children = sum(ns - start.children_ns.get(pid, 0) for pid, ns in end.children_ns.items())
    threads = {name: ns - start.threads_ns.get(name, 0) for name, ns in end.threads_ns.items()}
    switches = {name: n - start.threads_switches.get(name, 0) for name, n in end.threads_switches.items()}
    process = end.process_ns - start.process_ns
    return {"process_ns": process, "children_ns": children, "total_ns": process + children,
            "children": len(end.children_ns), "threads_ns": dict(sorted(threads.items())),
            "threads_switches": dict(sorted(switches.items()))}
