"""Python function calls per round of the scheduling thread, from cProfile (deterministic,
unlike a timing): `Engine.step` is profiled, nothing else, during one `mstrace run`.

    python bench/bench_round_calls.py [--src DIR] -- <mstrace run flags>

`--src` runs another checkout's code (e.g. bench/out/ab/src-<commit>, made by bench_ab.py)
with the same flags, so two commits compare by calls per round, total and by function.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import cProfile, json, pstats, re, sys
import scheduler.engine as E
from viewer.cli import main

prof = cProfile.Profile()
orig = E.Engine.step
rounds = [0]

def step(self, *a, **k):
    rounds[0] += 1
    prof.enable()
    try:
        return orig(self, *a, **k)
    finally:
        prof.disable()

E.Engine.step = step
sys.argv = ["mstrace", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as e:
    if e.code:
        raise
st = pstats.Stats(prof)
by = {}
for k, v in st.stats.items():  # built-ins are named with their address: not comparable across runs
    name = re.sub(r" at 0x[0-9a-f]+", "", f"{k[0].rsplit('/', 1)[-1]}:{k[2]}")
    by[name] = by.get(name, 0) + v[1]
print(json.dumps({"rounds": rounds[0], "calls": st.total_calls, "primitive": st.prim_calls, "by": by}))
"""


def measure(src: Path, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        args = [*flags, "--out", f"{d}/t", "-q"]
        env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
        p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=src, env=env,
                           capture_output=True, text=True, check=False)
        if p.returncode:
            raise SystemExit(f"run failed in {src}: {p.stderr.strip().splitlines()[-1:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, default=None, help="another checkout to compare with")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--list", action="store_true", help="this tree's functions by calls per round")
    ap.add_argument("flags", nargs="*", default=["run", "--model", "tiny", "--requests", "64"])
    a = ap.parse_args()
    flags = a.flags if a.flags and a.flags[0] == "run" else ["run", *a.flags]
    runs = {"B (this tree)": measure(REPO, flags)}
    if a.src is not None:
        runs = {"A (" + str(a.src) + ")": measure(a.src.resolve(), flags), **runs}
    for name, r in runs.items():
        print(f"{name}: {r['rounds']} rounds, {r['calls'] / r['rounds']:.1f} calls per round "
              f"({r['primitive'] / r['rounds']:.1f} primitive)")
    if a.list:
        rb = runs["B (this tree)"]
        for k, n in sorted(rb["by"].items(), key=lambda t: -t[1])[:a.top]:
            print(f"  {n / rb['rounds']:8.2f}  {k}")
    if len(runs) == 2:
        (ra, rb) = runs.values()
        keys = set(ra["by"]) | set(rb["by"])
        diff = sorted(((rb["by"].get(k, 0) / rb["rounds"] - ra["by"].get(k, 0) / ra["rounds"], k) for k in keys),
                      key=lambda t: -abs(t[0]))
        print(f"B/A calls per round: {(rb['calls'] / rb['rounds']) / (ra['calls'] / ra['rounds']):.3f}")
        print("largest changes in calls per round (B - A):")
        for d, k in diff[:a.top]:
            if d:
                print(f"  {d:+8.2f}  {k}")


if __name__ == "__main__":
    main()
