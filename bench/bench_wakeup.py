"""What a hand-off to a process that sleeps costs on this machine: a pipe send that wakes it, and
a round trip, after the receiver has been idle for a while.

    python bench/bench_wakeup.py [--sends 200] [--gaps-ms 0,2,25]

A child process blocks in `Connection.recv`; the parent sends a small message after sleeping
each gap (0: back to back). For each gap it prints the send's wall and CPU time (the thread's
own clock), medians and p90, and a round trip (the child answers). On a VM an idle virtual
CPU halts, and waking it is the sender's cost; a gap of 25 ms is a forward of the default
preset on a 2-vCPU host, the time the device process's dispatcher and the host's reader sit
in `recv` every round (scheduler/device/device_process.py).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection


def _child(conn: Connection) -> None:
    while True:
        m = conn.recv()
        if m is None:
            return
        if m == "ping":
            conn.send("pong")


def _q(xs: list[int], p: float) -> float:
    return sorted(xs)[int(p * (len(xs) - 1))] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sends", type=int, default=200)
    ap.add_argument("--gaps-ms", default="0,2,25")
    a = ap.parse_args()
    gaps = [float(g) / 1e3 for g in a.gaps_ms.split(",")]
    parent, child = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_child, args=(child,), daemon=True)
    proc.start()
    try:
        print("| gap | send wall p50 / p90 (us) | send CPU p50 (us) | round trip p50 / p90 (us) |")
        print("|---:|---:|---:|---:|")
        for gap in gaps:
            wall, cpu, rt = [], [], []
            for _ in range(a.sends):
                if gap:
                    time.sleep(gap)
                t, c = time.perf_counter_ns(), time.thread_time_ns()
                parent.send(("main", 12345))
                wall.append(time.perf_counter_ns() - t)
                cpu.append(time.thread_time_ns() - c)
            for _ in range(a.sends):
                if gap:
                    time.sleep(gap)
                t = time.perf_counter_ns()
                parent.send("ping")
                parent.recv()
                rt.append(time.perf_counter_ns() - t)
            print(f"| {gap * 1e3:g} ms | {statistics.median(wall) / 1e3:.1f} / {_q(wall, 0.9):.1f} | "
                  f"{statistics.median(cpu) / 1e3:.1f} | {statistics.median(rt) / 1e3:.1f} / {_q(rt, 0.9):.1f} |",
                  flush=True)
    finally:
        parent.send(None)
        proc.join(5)


if __name__ == "__main__":
    main()
