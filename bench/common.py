"""Shared helpers for the benchmarks: run the CLI like a user, read reports."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"


def mstrace_run(out: Path, *args: str) -> None:
    if out.exists():
        import shutil

        shutil.rmtree(out)
    p = subprocess.run([sys.executable, "-m", "viewer.cli", "run", "--out", str(out), "-q", *args],
                       cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"mstrace run failed: {p.stderr.strip()}")


def report(trace: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from viewer.analysis.report import build_report

    return build_report(trace)


def share(rep: dict[str, Any], boundary: str) -> float:
    return next((b["device_share"] or 0.0 for b in rep["boundaries"] if b["boundary"] == boundary), 0.0)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def alternated(times: dict[str, list[float]], skip: int, scale: float, unit: str) -> str:
    """Builds timed call by call in turn: each one's median call (times `scale`, in `unit`) and the
    median of its calls' ratios to the first build's call of the same turn, the first `skip` turns
    left out."""
    ref = next(iter(times.values()))[skip:]
    return "; ".join(f"{name} {statistics.median(ts[skip:]) * scale:.3g} {unit} "
                     f"({statistics.median(t / r for t, r in zip(ts[skip:], ref, strict=True)):.3f}x)"
                     for name, ts in times.items())


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def cpu_s(pid: int, tid: int | None = None) -> float:
    """A live process's user + system CPU time (its threads included), or one thread's, from /proc."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def python_layers() -> Iterator[None]:
    """The model's decoder layers in Python: scheduler/model/native_layers.py's one C call for a
    decode round refused, as on a CPU without AMX (for the benches that time the layers' parts
    or compare GEMM layouts under them)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from scheduler.model import native_layers

    saved = native_layers.decode_layers
    native_layers.decode_layers = lambda *a, **k: None
    try:
        yield
    finally:
        native_layers.decode_layers = saved
