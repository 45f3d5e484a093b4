"""What `mstrace export --perfetto` costs on a long trace: wall time and peak RSS.

    flock /tmp/mstrace-bench.lock .venv/bin/python bench/bench_export.py --probe-rows 10000000

The input is a real `mstrace run --model tiny --requests 64` trace replicated to
`--probe-rows` probe rows by bench/gen_big_trace.py (compacted, as a finished run
leaves it). The export runs as the CLI, in a process of its own; its peak RSS is the
child's ru_maxrss.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "export"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe-rows", type=int, default=10_000_000)
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    src, big = OUT / "src", OUT / f"big{a.probe_rows // 1_000_000}m"
    if not (src / "meta.json").exists():
        subprocess.run([sys.executable, "-m", "viewer.cli", "run", "--model", "tiny", "--requests", "64",
                        "--out", str(src), "-q"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    if not (big / "meta.json").exists():
        subprocess.run([sys.executable, "bench/gen_big_trace.py", str(src), str(big), "--probe-rows",
                        str(a.probe_rows), "--layout", "compacted"], cwd=REPO, check=True)
    out = OUT / "big.pftrace"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "viewer.cli", "export", str(big), "--perfetto", str(out)], cwd=REPO,
                       capture_output=True, text=True)
    wall = time.monotonic() - t0
    if p.returncode:
        raise SystemExit(p.stderr)
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    res = {"probe_rows": a.probe_rows, "wall_s": round(wall, 1), "peak_rss_mb": round(rss_mb), "file_mb":
           round(out.stat().st_size / 2**20), "said": p.stdout.strip()}
    print(json.dumps(res, indent=2))
    (OUT / "result.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
