"""`mstrace leaks` on a ~10 M-event memory table: wall time and peak memory.

    flock /tmp/mstrace-bench.lock .venv/bin/python bench/bench_leaks_scale.py [--events 10000000] [--repeats 3]

Builds a real tiny-model trace (reused when present), replicates its memory and
requests tables K times into bench/out/leaks_big (times shifted by the trace's
span, steps by its step count, request ids suffixed per copy so copies are
distinct requests, as bench/gen_big_trace.py does), then runs `mstrace leaks`
as a user would, under /usr/bin/time -v, and prints the median wall time and
the max peak RSS. Take the benchmark lock (above): a concurrent heavy job on
this 2-core machine makes the numbers meaningless.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import subprocess
import sys

import pyarrow as pa
import pyarrow.compute as pc
from common import OUT, REPO, load

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from gen_big_trace import shifted  # noqa: E402

from tracing.reader import read_meta, read_table  # noqa: E402
from tracing.writer import write_parquet_atomic  # noqa: E402

SRC, BIG = OUT / "leaks_src", OUT / "leaks_big"
PART_ROWS = 1_000_000  # a long run's flushes give parts of about this size


def ensure_source() -> None:
    if (SRC / "meta.json").exists():
        return
    p = subprocess.run([str(REPO / ".venv" / "bin" / "mstrace"), "run", "--model", "tiny", "--requests", "64",
                        "--out", str(SRC), "-q", "--cpu-device", "thread"], cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"mstrace run failed: {p.stderr.strip()}")


def span_and_steps(memory: pa.Table, requests: pa.Table) -> tuple[int, int]:
    """How far one copy must move so the next starts after it: time span and step count."""
    lo = [pc.min(memory["ts_ns"]).as_py()]
    hi = [pc.max(memory["ts_ns"]).as_py()]
    for c in ("arrival_ns", "finish_ns"):
        col = pc.filter(requests[c], pc.greater(requests[c], 0))
        if len(col):
            lo.append(pc.min(col).as_py())
            hi.append(pc.max(col).as_py())
    steps = read_table(SRC, "steps", ["step"])["step"]
    nstep = max(pc.max(memory["step"]).as_py(), pc.max(steps).as_py() if len(steps) else 0) + 1
    return max(hi) - min(lo) + 1000, nstep


def write_copies(t: pa.Table, name: str, k: int, span: int, nstep: int) -> None:
    (BIG / name).mkdir()
    per_part = max(1, PART_ROWS // max(t.num_rows, 1))
    for start in range(0, k, per_part):
        copies = [shifted(t, i * span, i * nstep, f"#{i}") for i in range(start, min(k, start + per_part))]
        write_parquet_atomic(pa.concat_tables(copies), BIG / name / f"part-{start // per_part:06d}.parquet")


def build(events: int) -> dict[str, int]:
    """Replicate the source trace; skipped when leaks_big already has the same size."""
    memory, requests = read_table(SRC, "memory"), read_table(SRC, "requests")
    k = max(1, math.ceil(events / memory.num_rows))
    info = {"copies": k, "events": k * memory.num_rows,
            "snapshots": k * pc.sum(pc.equal(memory["kind"].cast(pa.string()), "snapshot_begin")).as_py()}
    stamp = BIG / "bench.json"
    if stamp.exists() and json.loads(stamp.read_text()) == info:
        return info
    if BIG.exists():
        shutil.rmtree(BIG)
    BIG.mkdir(parents=True)
    span, nstep = span_and_steps(memory, requests)
    write_copies(memory, "memory", k, span, nstep)
    write_copies(requests, "requests", k, span, nstep)
    for d in SRC.iterdir():  # the other tables as they are, so the trace stays valid
        if d.is_dir() and d.name not in ("memory", "requests"):
            shutil.copytree(d, BIG / d.name)
    meta = read_meta(SRC)
    # The copies are plain part files with no manifest: a legacy layout, where every part counts.
    meta.pop("store", None)
    meta["replicated"] = {"from": str(SRC), "copies": k}
    (BIG / "meta.json").write_text(json.dumps(meta, indent=2))
    # then committed as any trace of this version is: `mstrace compact` adopts the parts
    subprocess.run([sys.executable, "-m", "viewer.cli", "compact", str(BIG)], cwd=REPO, check=True,
                   capture_output=True)
    stamp.write_text(json.dumps(info))
    return info


def timed_run() -> tuple[float, float]:
    """One `mstrace leaks` run: (wall s, peak RSS GB)."""
    p = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "viewer.cli", "leaks", str(BIG)],
                       cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"mstrace leaks failed: {p.stderr.strip()[-2000:]}")
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\d+):([\d.]+)", p.stderr)
    r = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    assert m is not None and r is not None, p.stderr
    return int(m.group(1)) * 60 + float(m.group(2)), int(r.group(1)) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    ensure_source()
    info = build(a.events)
    print(f"{BIG}: {info['copies']} copies, {info['events']} memory events, {info['snapshots']} snapshots")
    print(f"load before: {load()}")
    runs = [timed_run() for _ in range(a.repeats)]
    print(f"load after: {load()}")
    walls = [w for w, _ in runs]
    print(f"leaks on {info['events']} events: wall median {statistics.median(walls):.2f} s "
          f"(runs {', '.join(f'{w:.2f}' for w in walls)}), peak RSS max {max(r for _, r in runs):.2f} GB")


if __name__ == "__main__":
    main()
