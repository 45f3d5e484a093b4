"""What a CPU device process costs to start: `mstrace run` as a user runs it, and engines
made one after another in one process.

    python bench/bench_device_start.py [--repeats 3] [--tree DIR]

1. `mstrace run --model tiny --requests 16 --output-len 24-24 -q --cpu-device D` for D in
   process and thread, each a fresh interpreter (`python -m viewer.cli`): its wall and the
   machine's busy core-seconds around it (/proc/stat: user, nice, system, irq, softirq),
   which count the device process however it was started. Alternated, `--repeats` each.
2. Three `Engine(EngineConfig(model="tiny", cpu_device="process"))` made one after another
   in one process that already runs a thread (a library user's, a test worker's): each
   construction's wall (it returns once the device process has loaded the model).

`--tree DIR` runs another checkout's code (a worktree of an older commit) with this
interpreter. Busy core-seconds are the whole machine's: run it with nothing beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = ["run", "--model", "tiny", "--requests", "16", "--prompt-len", "32-32", "--output-len", "24-24",
       "--shared-prefix", "0", "-q", "--force"]

ENGINES = """
import threading, time
from scheduler.config import EngineConfig
from scheduler.engine import Engine
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
for i in range(3):
    t = time.perf_counter()
    e = Engine(EngineConfig(model="tiny", cpu_device="process"))
    print(f"{time.perf_counter() - t:.3f}", flush=True)
    e.close()
"""


def busy_s() -> float:
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    args = ap.parse_args()
    tree = args.tree.resolve()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    got: dict[str, list[tuple[float, float]]] = {"process": [], "thread": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for device in got:
                b0, t0 = busy_s(), time.perf_counter()
                subprocess.run([sys.executable, "-m", "viewer.cli", *RUN, "--cpu-device", device,
                                "--out", f"{tmp}/{device}"], cwd=tree, env=env, check=True)
                got[device].append((time.perf_counter() - t0, busy_s() - b0))
                print(f"repeat {i} run --cpu-device {device}: wall {got[device][-1][0]:.2f} s, "
                      f"busy {got[device][-1][1]:.2f} core-s", flush=True)
    for device, runs in got.items():
        print(f"median run --cpu-device {device}: wall {statistics.median(w for w, _ in runs):.2f} s, "
              f"busy {statistics.median(b for _, b in runs):.2f} core-s")
    out = subprocess.run([sys.executable, "-c", ENGINES], cwd=tree, env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    print("engines made one after another, each's construction: " + ", ".join(f"{float(s):.2f} s" for s in out))


if __name__ == "__main__":
    main()
