"""The sample traces in this folder, re-made: `python traces/make_samples.py`.

Three runs of the tiny preset on one small workload, enough to try every analysis command
before a first run of your own (README's tour):
  sample-serial, sample-overlap   the same workload in serial and overlap mode (`mstrace diff`);
  sample-deadlock                 an injected wait cycle, caught past a 2 s timeout (`mstrace stalls`).
tests/test_samples.py checks that they are current (the schema they were written with is
this tree's); when a schema change makes it fail, run this script and commit the result.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = ["--model", "tiny", "--requests", "12", "--prompt-len", "16-48", "--output-len", "8-16", "--seed", "0",
            "--snapshot-every", "8", "-q"]
SAMPLES = {
    "sample-serial": ([*WORKLOAD, "--mode", "serial"], 0),
    "sample-overlap": ([*WORKLOAD, "--mode", "overlap"], 0),
    "sample-deadlock": (["--model", "tiny", "--requests", "6", "--seed", "0", "--mode", "overlap", "--inject",
                         "deadlock", "--wait-timeout", "2", "-q"], 3),
}


def main() -> None:
    for name, (flags, code) in SAMPLES.items():
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        p = subprocess.run([sys.executable, "-m", "viewer.cli", "run", *flags, "--out", str(out)],
                           cwd=HERE.parent, capture_output=True, text=True)
        if p.returncode != code:
            sys.exit(f"{name}: exit {p.returncode}, expected {code}: {p.stderr.strip().splitlines()[-1:]}")
        for lock in out.glob(".writer-r*.lock"):
            lock.unlink()  # a finished writer's lock file: nothing to keep in git
        for table in out.iterdir():
            if table.is_dir() and not any(table.iterdir()):
                (table / ".gitkeep").touch()  # git keeps no empty folder, and a table's folder says it exists
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"{name}: {size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
