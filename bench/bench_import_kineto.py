"""`mstrace import` on a Kineto trace of about 1 GB, built by replicating a real one, beside
HTA's load of the same file.

    python bench/bench_import_kineto.py [--copies 19] [--hta /tmp/hta/bin/python]

The source is HTA's `df_index_resolver` trace (tests/data/kineto/hta_df_index_resolver.json.gz,
a V100 run: 216,092 events, 54 MB of JSON). Each copy is shifted past the one before in time,
with its correlation ids, external ids and ProfilerStep numbers moved out of the others' way,
so the file is one long run of the same engine. It is written uncompressed, as the profiler
writes it. Peak RSS and wall time come from /usr/bin/time -v around each command.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "tests" / "data" / "kineto" / "hta_df_index_resolver.json.gz"


def build(dst: Path, copies: int) -> int:
    src = json.load(gzip.open(SOURCE))
    events = src.pop("traceEvents")
    x = [e for e in events if e.get("ph") == "X"]
    span = max(e["ts"] + e.get("dur", 0) for e in x) - min(e["ts"] for e in x) + 1000
    corr = 1 + max(int((e.get("args") or {}).get("correlation", 0) or 0) for e in events)
    corr = max(corr, 1 + max(int(e.get("id", 0)) for e in events if e.get("ph") in ("s", "f")))
    ext = 1 + max(int((e.get("args") or {}).get("External id", 0) or 0) for e in events)
    step = re.compile(r"^ProfilerStep#(\d+)$")
    with dst.open("w") as f:
        head = {k: v for k, v in src.items() if k not in ("traceName", "displayTimeUnit", "baseTimeNanoseconds")}
        f.write(json.dumps(head)[:-1] + ', "traceEvents": [\n')
        first = True
        for k in range(copies):
            for e in events:
                e2 = dict(e)
                if "ts" in e2:
                    e2["ts"] = e["ts"] + k * span
                if e2.get("ph") in ("s", "f") and "id" in e2:
                    e2["id"] = int(e["id"]) + k * corr
                a = e.get("args")
                if a:
                    a2 = dict(a)
                    if "correlation" in a2:
                        a2["correlation"] = int(a2["correlation"]) + k * corr
                    if "External id" in a2:
                        a2["External id"] = int(a2["External id"]) + k * ext
                    e2["args"] = a2
                m = step.match(str(e.get("name", "")))
                if m:
                    e2["name"] = f"ProfilerStep#{int(m.group(1)) + k * 1000}"
                f.write(("" if first else ",\n") + json.dumps(e2))
                first = False
        f.write('\n], "traceName": "replicated", "displayTimeUnit": "ms"}\n')
    return len(events) * copies


def timed(cmd: list[str], timeout: int) -> tuple[float | None, float | None, int]:
    """(wall s, peak RSS MB, exit code) of cmd under /usr/bin/time -v."""
    try:
        p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, None, -1
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", p.stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    secs = (int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60 + float(wall.group(3))) if wall else None
    return secs, (int(rss.group(1)) / 1024 if rss else None), p.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=19)
    ap.add_argument("--hta", default="/tmp/hta/bin/python", help="a python with holistictraceanalysis installed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        root = Path(d)
        trace = root / "rank1.json"
        n = build(trace, args.copies)
        size = trace.stat().st_size
        print(f"built {trace.name}: {n:,} events, {size / 1e9:.2f} GB", flush=True)
        out = root / "imported"
        wall, rss, rc = timed([sys.executable, "-m", "viewer.cli", "import", str(trace), "--out", str(out)], 900)
        print(f"mstrace import: {wall:.1f} s, peak RSS {rss:.0f} MB, exit {rc}", flush=True)
        wall, rss, rc = timed([sys.executable, "-m", "viewer.cli", "report", str(out)], 600)
        print(f"mstrace report on it: {wall:.1f} s, peak RSS {rss:.0f} MB, exit {rc}", flush=True)
        shutil.rmtree(out)
        if Path(args.hta).exists():
            code = ("import sys,time; from hta.trace_analysis import TraceAnalysis; t=time.perf_counter(); "
                    f"TraceAnalysis(trace_dir={str(root)!r}); print('hta load', time.perf_counter()-t)")
            wall, rss, rc = timed([args.hta, "-c", code], 1800)
            print("HTA TraceAnalysis load: " + (f"{wall:.1f} s, peak RSS {rss:.0f} MB, exit {rc}" if wall is not None
                                                 else "did not finish in 1800 s"), flush=True)


if __name__ == "__main__":
    main()
