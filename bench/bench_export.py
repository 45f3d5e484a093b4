"""What `mstrace export --perfetto` costs on a long trace: wall time and peak RSS.

    flock /tmp/mstrace-bench.lock .venv/bin/python bench/bench_export.py --probe-rows 10000000

The input is a real `mstrace run --model tiny --requests 64` trace replicated to
`--probe-rows` probe rows by bench/gen_big_trace.py (compacted, as a finished run
leaves it). The export runs as the CLI, in a process of its own; its peak RSS is that
process's own ru_maxrss (os.wait4: not the run's or the generator's, which may have run
before it in this process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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
    out.unlink(missing_ok=True)  # replacing the last run's 1 GB file would add its unlink to the time
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as said_f, tempfile.TemporaryFile("w+") as err_f:
        p = subprocess.Popen([sys.executable, "-m", "viewer.cli", "export", str(big), "--perfetto", str(out)],
                             cwd=REPO, stdout=said_f, stderr=err_f)
        _, status, usage = os.wait4(p.pid, 0)  # reaped here, with its own rusage
        wall = time.monotonic() - t0
        said_f.seek(0)
        err_f.seek(0)
        said, err = said_f.read(), err_f.read()
    p.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not wait for it again
    if p.returncode:
        raise SystemExit(err)
    res = {"probe_rows": a.probe_rows, "wall_s": round(wall, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024),
           "file_mb": round(out.stat().st_size / 2**20), "said": said.strip()}
    print(json.dumps(res, indent=2))
    (OUT / "result.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
