"""Throughput of two revisions of mstrace on one workload, in alternated pairs.

    python bench/bench_ab.py --a REV_A [--b REV_B] [--pairs 7] [-- run flags ...]

Each revision is checked out into a git worktree under bench/out/ab/; each pair runs
`mstrace run` (default: --model tiny --requests 64) once from A and once from B, the
order alternating pair by pair, and reads output tok/s from each trace's report and the
scheduling thread's own CPU time per round from its meta.json. Prints every pair and the
median of the B/A ratios (a ratio within a pair cancels the machine's
slow drift; the median drops the pairs a neighbour disturbed). B defaults to the working
tree. Each run's per-cycle figures (`DETAIL`: batch_prepare in the host's and the device's
view, the device's wait on the barrier, the device process's pipe hops) are printed too,
with each revision's medians at the end. A worktree gets this checkout's C builds where its
C sources are the same (else its model runs torch's ops, and it says so).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "ab"


def checkout(rev: str) -> Path:
    # named by the commit, not by `rev`: a name such as HEAD moves, and a worktree made for it
    # earlier would be reused stale
    sha = subprocess.run(["git", "rev-parse", "--short=12", f"{rev}^{{commit}}"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    dest = OUT / f"src-{sha}"
    if not dest.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(dest), sha], cwd=REPO, check=True,
                       capture_output=True)
    _copy_builds(dest, sha)
    return dest


BUILT = ("scheduler", "viewer")  # where pyproject.toml's C extensions live, built in place


def _copy_builds(dest: Path, sha: str) -> None:
    """This checkout's C extensions, built in place by setup.sh, into the worktree where its
    C sources are the revision's: without them the revision's model runs torch's ops, and
    its device times are not comparable. Left out (and said) where the sources differ."""
    sources = [f"{d}/*.{x}" for d in BUILT for x in ("c", "h")]
    if subprocess.run(["git", "diff", "--quiet", sha, "--", *sources], cwd=REPO).returncode != 0:
        print(f"{sha}: its C sources differ from this checkout's: its worktree runs without C builds")
        return
    for b in (b for d in BUILT for b in (REPO / d).rglob("*.so")):
        shutil.copy2(b, dest / b.relative_to(REPO))


def alternated(measure: Callable[[Path], float], a_rev: str, b_rev: str | None, repeats: int, unit: str) -> float:
    """`measure(source tree)` of revision A and of B (default: the working tree), `repeats`
    times, the order alternating; prints each repeat and returns the median of the B/A ratios."""
    srcs = {"A": checkout(a_rev), "B": checkout(b_rev) if b_rev else REPO}
    ratios = []
    for i in range(repeats):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        res = {k: measure(srcs[k]) for k in order}
        ratios.append(res["B"] / res["A"])
        print(f"repeat {i + 1} ({order[0]} first): A {res['A']:.1f}  B {res['B']:.1f} {unit}  B/A {ratios[-1]:.3f}",
              flush=True)
    return statistics.median(ratios)


# what each run reports beside its throughput, from `report --json` and meta.json: per
# cycle, the host's and the device's batch_prepare ms and the device's scheduler_barrier ms,
# and the device process's pipe hops (None on an in-process device)
DETAIL = ("prep_host_ms", "prep_device_ms", "barrier_device_ms", "hop_out_us", "hop_back_us", "cycle_ms")


def run(src: Path, out: Path, flags: list[str]) -> tuple[float, float, dict[str, float | None]]:
    """(output tok/s, the scheduling thread's CPU ms per round, DETAIL) of one run."""
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run([sys.executable, "-m", "viewer.cli", "run", "-q", "--out", str(out), *flags], cwd=src,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{src.name}: mstrace run failed: {p.stderr.strip()[-400:]}")
    rep = json.loads(subprocess.run([sys.executable, "-m", "viewer.cli", "report", str(out), "--json"], cwd=REPO,
                                    capture_output=True, text=True, check=True).stdout)
    meta = json.loads((out / "meta.json").read_text())["run"]
    cpu_ms = meta["cpu"]["threads_ns"]["MainThread"] / 1e6 / max(1, meta["steps"])
    rows = {b["boundary"]: b for b in rep["boundaries"]}
    prep, barrier = rows.get("batch_prepare", {}), rows.get("scheduler_barrier", {})
    backend = rep.get("backend") or {}
    detail = dict(zip(DETAIL, (prep.get("host_ms_per_cycle"), prep.get("device_ms_per_cycle"),
                               barrier.get("device_ms_per_cycle"), backend.get("hop_out_us"),
                               backend.get("hop_back_us"), rep["cycle_ms"]), strict=True))
    return float(rep["throughput"]["output_tok_per_s"]), cpu_ms, detail


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="baseline revision")
    ap.add_argument("--b", default=None, help="revision to compare (default: the working tree)")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("flags", nargs="*", default=["--model", "tiny", "--requests", "64"])
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    srcs = {"A": checkout(a.a), "B": checkout(a.b) if a.b else REPO}
    run(srcs["A"], OUT / "warm", a.flags)  # builds the preset model once, warms the page cache
    ratios, cpu_ratios = [], []
    details: dict[str, list[dict[str, float | None]]] = {"A": [], "B": []}
    for i in range(a.pairs):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        res = {k: run(srcs[k], OUT / f"run-{k}", a.flags) for k in order}
        ratios.append(res["B"][0] / res["A"][0])
        cpu_ratios.append(res["B"][1] / res["A"][1])
        print(f"pair {i + 1} ({order[0]} first): A {res['A'][0]:.1f}  B {res['B'][0]:.1f} tok/s  B/A {ratios[-1]:.3f}"
              f"  | scheduling-thread CPU per round: A {res['A'][1]:.2f}  B {res['B'][1]:.2f} ms  B/A {cpu_ratios[-1]:.3f}",
              flush=True)
        for k in ("A", "B"):
            details[k].append(res[k][2])
            print(f"  {k}: " + ", ".join(f"{f} {_fmt(res[k][2][f])}" for f in DETAIL), flush=True)
    print(f"median B/A over {a.pairs} pairs: throughput {statistics.median(ratios):.3f}, scheduling-thread CPU per "
          f"round {statistics.median(cpu_ratios):.3f} (A = {a.a}, B = {a.b or 'working tree'}; "
          f"flags: {' '.join(a.flags)})")
    for k, ds in details.items():
        print(f"{k} medians: " + ", ".join(
            f"{f} {_fmt(statistics.median(v) if (v := [d[f] for d in ds if d[f] is not None]) else None)}"
            for f in DETAIL))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
