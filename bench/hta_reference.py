"""HTA's own numbers for the Kineto traces in tests/data/kineto/, written to hta_expected.json.

HTA (`pip install holistictraceanalysis==0.5.0`) pulls in jupyterlab and is not a test
dependency; this script runs it once, in its own environment, and the tests compare
`mstrace import` + `report` against what it wrote:

    python -m venv /tmp/hta && /tmp/hta/bin/pip install holistictraceanalysis==0.5.0
    /tmp/hta/bin/python bench/hta_reference.py tests/data/kineto

Per trace and rank: HTA's temporal breakdown (idle, compute, non-compute time and shares),
the number of device events it counts (those on a stream, after its filtering), and the
load time.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path


def reference(path: Path) -> dict:
    from hta.trace_analysis import TraceAnalysis

    with tempfile.TemporaryDirectory() as d:
        # HTA reads a folder of rank files; its rank comes from each file's distributedInfo
        shutil.copy(path, Path(d) / path.name)
        t0 = time.perf_counter()
        ta = TraceAnalysis(trace_dir=d)
        load_s = time.perf_counter() - t0
        df = ta.get_temporal_breakdown(visualize=False)
        idle = {}
        for rank in ta.t.traces:
            b = ta.get_idle_time_breakdown(ranks=[rank], visualize=False)[0]
            idle[int(rank)] = {c: float(b[b["idle_category"] == c]["idle_time"].sum())
                               for c in ("host_wait", "kernel_wait", "other")}
        out = {"load_s": round(load_s, 3), "ranks": {}}
        for _, row in df.iterrows():
            rank = int(row["rank"])
            tdf = ta.t.get_trace(rank)
            out["ranks"][str(rank)] = {
                "kernels": int(tdf["stream"].ne(-1).sum()),
                "kernel_busy_us": float(row["kernel_time(us)"] - row["idle_time(us)"]),
                "kernel_time_us": float(row["kernel_time(us)"]),
                "idle_pct": float(row["idle_time_pctg"]),
                "compute_pct": float(row["compute_time_pctg"]),
                "non_compute_pct": float(row["non_compute_time_pctg"]),
                "host_wait_us": idle[rank]["host_wait"],
                "kernel_wait_us": idle[rank]["kernel_wait"],
                "other_idle_us": idle[rank]["other"],
            }
        return out


def main(folder: str) -> None:
    from importlib.metadata import version

    root = Path(folder)
    res = {"hta_version": version("holistictraceanalysis"), "traces": {}}
    for p in sorted(root.glob("*.json.gz")):
        res["traces"][p.name] = reference(p)
        print(p.name, json.dumps(res["traces"][p.name]["ranks"]))
    (root / "hta_expected.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
