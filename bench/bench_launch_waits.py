"""How long the scheduling thread's launch waits, and beside what, and what a device
thread's forward costs in each mode: a diagnostic for the thread backend's shared GIL
(BENCHMARKS.md, "The first batch's hand-over").

    python bench/bench_launch_waits.py [--model small] [--requests 64] [--cpu-device thread]

Runs `mstrace run` in this process once per mode (serial, then overlap), with the engine's
`_launch` (step 4: prepare and enqueue a batch) timed in wall time and in its thread's own
CPU time; their difference is time the thread was runnable or ready but not running: on a
device thread, waiting for the GIL. Each launch is then placed against the run's own trace:
did the sender thread deliver tokens (`response_deliver` rows) or the device compute
(`device_compute` rows) while it ran? With `--cpu-device thread` the device's forwards
(`LocalDevice.run_model`, the probe's excluded) are timed the same way, on the device
thread: its CPU time beside the wall says how much of an overlap run's longer forward is
waiting for the GIL and how much is the same work done slower. The wrappers are this
script's, set before the engine starts; the engine has no hook for them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probes.clock import now_ns  # noqa: E402
from scheduler import engine as engine_mod  # noqa: E402
from scheduler.device.local_device import LocalDevice  # noqa: E402
from tracing.reader import Trace  # noqa: E402
from viewer.analysis.intervals import Coverage  # noqa: E402
from viewer.cli import app  # noqa: E402


def timed(cls: type, name: str, rec: list[tuple[int, int, int, int]], keep: Callable[..., bool]) -> Callable[[], None]:
    """Wrap `cls.name` to append (start ns, wall ns, its thread's CPU ns, 1 on the prefill
    stream's thread else 0) of the calls `keep` accepts to `rec`; returns the undo."""
    f = getattr(cls, name)

    def wrapped(*a: object, **k: object) -> object:
        t, c = now_ns(), time.thread_time_ns()
        try:
            return f(*a, **k)
        finally:
            if keep(*a, **k):
                prefill = threading.current_thread().name == "stream-prefill"
                rec.append((t, now_ns() - t, time.thread_time_ns() - c, int(prefill)))

    setattr(cls, name, wrapped)
    return lambda: setattr(cls, name, f)


def timed_run(args: argparse.Namespace, mode: str, out: Path) -> tuple[np.ndarray, np.ndarray]:
    """`timed`'s rows of every launch of one run, and of every forward of its device thread."""
    launches: list[tuple[int, int, int, int]] = []
    forwards: list[tuple[int, int, int, int]] = []
    undo = [timed(engine_mod.Engine, "_launch", launches, lambda *a, **k: True),
            # run_model(self, prepared, slots, step): the start-up probe's forwards have step -1
            timed(LocalDevice, "run_model", forwards, lambda *a, **k: int(k.get("step", a[3] if len(a) > 3 else -1)) >= 0)]
    try:
        app(["run", "--model", args.model, "--mode", mode, "--requests", str(args.requests),
             "--cpu-device", args.cpu_device, "--out", str(out), "-q", *args.extra.split()], standalone_mode=False)
    finally:
        for u in undo:
            u()
    return np.array(launches, dtype=np.int64).reshape(-1, 4), np.array(forwards, dtype=np.int64).reshape(-1, 4)


def beside(rec: np.ndarray, tr: Trace, boundary: str) -> np.ndarray:
    """Per launch, ns of `boundary`'s rows inside it (rows that overlap each other count once)."""
    p = tr.table("probes", ["ts_ns", "dur_ns", "boundary"])
    p = p.filter(pc.equal(p["boundary"], boundary))
    s0 = p["ts_ns"].to_numpy()
    busy = Coverage(s0, s0 + p["dur_ns"].to_numpy())
    return busy.covered(rec[:, 0], rec[:, 0] + rec[:, 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--cpu-device", default="thread", choices=("thread", "process"))
    ap.add_argument("--extra", default="", help="more `mstrace run` flags for both runs, space separated "
                    "(--no-split-streams: overlap's forwards one a round, as serial's)")
    args = ap.parse_args()

    def ms(x: np.ndarray) -> str:
        return f"{np.median(x) / 1e6:.3f}" if len(x) else "-"

    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("serial", "overlap"):
            out = Path(tmp) / mode
            rec, fwd = timed_run(args, mode, out)
            tr = Trace.open(out)
            wait = rec[:, 1] - rec[:, 2]
            sender = beside(rec, tr, "response_deliver") > 0
            device = beside(rec, tr, "device_compute") > 0
            print(f"{args.model} {args.cpu_device} {mode}: {len(rec)} launches, median wall {ms(rec[:, 1])} ms, "
                  f"CPU {ms(rec[:, 2])} ms, waiting {ms(wait)} ms; beside the sender's delivery "
                  f"{int(sender.sum())} (waiting {ms(wait[sender])} ms), not ({int((~sender).sum())}: "
                  f"{ms(wait[~sender])} ms); beside device work {int(device.sum())}")
            # a device thread's forwards (a device process runs them elsewhere), per stream: with
            # split streams the prefill stream's run beside the main stream's, so only the union
            # of their spans is the device's busy time
            for name, on in (("main", fwd[:, 3] == 0), ("prefill", fwd[:, 3] == 1)):
                f = fwd[on]
                if len(f):
                    print(f"  {name} stream: {len(f)} forwards, median wall {ms(f[:, 1])} ms, CPU {ms(f[:, 2])} ms, "
                          f"waiting {ms(f[:, 1] - f[:, 2])} ms; in all {f[:, 1].sum() / 1e9:.3f} s wall, "
                          f"{f[:, 2].sum() / 1e9:.3f} s CPU")
            if len(fwd):
                ends = fwd[:, 0] + fwd[:, 1]
                union = Coverage(fwd[:, 0], ends).covered(fwd[:, 0].min(keepdims=True), ends.max(keepdims=True))
                print(f"  the device busy (the forwards' union): {union[0] / 1e9:.3f} s")


if __name__ == "__main__":
    main()
