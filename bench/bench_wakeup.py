"""What a hand-off to a process that sleeps costs on this machine: a pipe write that wakes it,
and a round trip, after the receiver has been idle for a while.

    python bench/bench_wakeup.py [--sends 200] [--gaps-ms 0,2,25]

A child process waits for a small message (pickled once, beforehand: `send_bytes` of the same
bytes) that the parent writes after sleeping each gap (0: back to back). The child either
blocks in `recv_bytes` (it sleeps) or polls the pipe without blocking (it never sleeps: the
control). For each gap and receiver the table has the write's wall and CPU time (the
parent's own thread clock), medians and p90, and a round trip (the child answers). The
parent sleeps the gap in both rows, so the difference between them is the receiver's
sleeping. On a VM an idle virtual CPU halts, and waking it is the writer's cost; a gap of
25 ms is a forward of the default preset on a 2-vCPU host, the time the device process's
dispatcher and the host's reader sit in `recv` every round (scheduler/device/device_process.py).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time
from multiprocessing.connection import Connection


def _child(conn: Connection, polls: bool) -> None:
    while True:
        if polls:
            while not conn.poll(0):
                pass
        m = conn.recv_bytes()
        if m == b"stop":
            return
        if m == b"ping":
            conn.send_bytes(b"pong")


def _q(xs: list[int], p: float) -> float:
    return sorted(xs)[int(p * (len(xs) - 1))] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sends", type=int, default=200)
    ap.add_argument("--gaps-ms", default="0,2,25")
    a = ap.parse_args()
    gaps = [float(g) / 1e3 for g in a.gaps_ms.split(",")]
    msg = pickle.dumps(("main", 12345), pickle.HIGHEST_PROTOCOL)
    print("| gap | receiver | write wall p50 / p90 (us) | write CPU p50 (us) | round trip p50 / p90 (us) |")
    print("|---:|---|---:|---:|---:|")
    for gap in gaps:
        for polls in (False, True):
            parent, child = mp.get_context("fork").Pipe()
            proc = mp.get_context("fork").Process(target=_child, args=(child, polls), daemon=True)
            proc.start()
            try:
                wall, cpu, rt = [], [], []
                for _ in range(a.sends):
                    if gap:
                        time.sleep(gap)
                    t, c = time.perf_counter_ns(), time.thread_time_ns()
                    parent.send_bytes(msg)
                    wall.append(time.perf_counter_ns() - t)
                    cpu.append(time.thread_time_ns() - c)
                for _ in range(a.sends):
                    if gap:
                        time.sleep(gap)
                    t = time.perf_counter_ns()
                    parent.send_bytes(b"ping")
                    parent.recv_bytes()
                    rt.append(time.perf_counter_ns() - t)
            finally:
                parent.send_bytes(b"stop")
                proc.join(5)
            print(f"| {gap * 1e3:g} ms | {'polls' if polls else 'sleeps'} | {statistics.median(wall) / 1e3:.1f} / "
                  f"{_q(wall, 0.9):.1f} | {statistics.median(cpu) / 1e3:.1f} | {statistics.median(rt) / 1e3:.1f} / "
                  f"{_q(rt, 0.9):.1f} |", flush=True)


if __name__ == "__main__":
    main()
