"""`mstrace whatif` checked against the runs it predicts.

    python bench/bench_whatif.py modes --model tiny --requests 128 --runs 5 --cpu-device thread
    python bench/bench_whatif.py comm --model tiny --requests 128 --runs 5 --tp 2
    python bench/bench_whatif.py truth --model tiny --requests 64 --delay-ms 5 --mode serial

modes: each run is a serial and an overlap run of one workload (same seed; the order alternates
run by run); whatif predicts each from the other. Prints, per run and direction, the predicted
and measured output tok/s, ITL p50 and cycle, the errors, and whether the measured value lies
in the stated 95% interval; then the median absolute errors and the interval's hit count.

comm: the same with a TP run's `--comm-overlap off` and `on` (whatif --comm-overlap).

truth: the truth harness's known delays (--debug-delay-ms PLACE=D, scheduler/harness/debug_delay.py).
For each place, a run with the delay and one without; whatif predicts the one without from
the delayed one (--speedup BOUNDARY=-Dms) and the delayed one from the one without
(BOUNDARY=+Dms). The error is in units of D (the acceptance: within 0.10 D).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from common import OUT, REPO, load, mstrace_run

sys.path.insert(0, str(REPO))
from tracing.reader import Trace  # noqa: E402
from viewer.analysis.whatif import Check, Speedup, WhatIfResult, whatif  # noqa: E402

# The truth harness's places, and the boundary each is charged to (tests/test_truth.py).
PLACE_BOUNDARY = {"device_compute": "device_compute", "bookkeeping": "bookkeeping",
                  "batch_prepare": "batch_prepare", "response_send": "response_send",
                  "between_rounds": "unattributed"}
FIGS = (("output_tok_per_s", "tok/s", 0), ("itl_ms_p50", "ITL p50 ms", 2), ("cycle_ms", "cycle ms", 2))


def _row(label: str, r: WhatIfResult) -> dict[str, float]:
    """One prediction against the run it predicts (whatif's `against`): relative errors and interval hits."""
    c = r.against
    assert isinstance(c, Check)
    out: dict[str, float] = {}
    cells = []
    for name, short, places in FIGS:
        p, m, err, hit = (getattr(r.predicted, name), getattr(c.measured, name), getattr(c.error_pct, name),
                          c.inside_interval[name])
        if err is None or hit is None:  # a figure one side lacks (no ITL): not counted
            cells.append(f"{short} -")
            continue
        out[name], out[name + "_hit"] = err / 100, float(hit)
        cells.append(f"{short} {p:.{places}f} vs {m:.{places}f} ({err:+.1f}%, {'in' if hit else 'out'})")
    print(f"  {label:<18} " + "; ".join(cells), flush=True)
    return out


def modes(a: argparse.Namespace) -> None:
    _pairs(a, "mode", ("serial", "overlap"),
           lambda out, to, other: whatif(out, to, contention=a.contention, against=other))


def comm(a: argparse.Namespace) -> None:
    _pairs(a, "comm-overlap", ("off", "on"),
           lambda out, to, other: whatif(out, comm_overlap=to, contention=a.contention, against=other),
           "--tp", str(a.tp))


def _pairs(a: argparse.Namespace, flag: str, values: tuple[str, str],
           predict: Callable[[Path, str, Path], WhatIfResult], *more: str) -> None:
    """Each run: one run per value of `--flag` (same seed; the order alternates run by run),
    each predicted from the other."""
    flags = ["--model", a.model, "--requests", str(a.requests), "--seed", "0", "--cpu-device", a.cpu_device,
             *more, *a.extra.split()]
    print(f"load before: {load()}; {' '.join(flags)}")
    x, y = values
    rows: dict[str, list[dict[str, float]]] = {f"{y} from {x}": [], f"{x} from {y}": []}
    for i in range(a.runs):
        order = values if i % 2 == 0 else values[::-1]
        out = {v: OUT / "whatif" / f"{a.model}-{a.cpu_device}{''.join(more)}" / f"{flag}-{v}-{i}" for v in order}
        for v in order:
            if not (a.reuse and (out[v] / "meta.json").exists()):
                mstrace_run(out[v], *flags, f"--{flag}", v)
        print(f"run {i}:")
        rows[f"{y} from {x}"].append(_row(f"{y} from {x}", predict(out[x], y, out[y])))
        rows[f"{x} from {y}"].append(_row(f"{x} from {y}", predict(out[y], x, out[x])))
    print(f"load after: {load()}")
    print(f"\n{' '.join((a.model, a.cpu_device, *more))}, {a.requests} requests, {a.runs} runs, "
          f"--contention {'not given' if a.contention is None else f'{a.contention:g}'}: median |error|, "
          "measured in interval")
    for label, rs in rows.items():
        cells = []
        for name, short, _ in FIGS:
            had = [r for r in rs if name in r]  # the pairs where both sides had the figure
            cells.append(f"{short} {100 * statistics.median(abs(r[name]) for r in had):.1f}% "
                         f"({int(sum(r[name + '_hit'] for r in had))}/{len(had)} in)" if had else f"{short} -")
        print(f"  {label:<20} " + "; ".join(cells))


def truth(a: argparse.Namespace) -> None:
    flags = ["--model", a.model, "--requests", str(a.requests), "--seed", "0", "--cpu-device", a.cpu_device,
             "--mode", a.mode, *a.extra.split()]
    print(f"load before: {load()}; {' '.join(flags)}; D = {a.delay_ms} ms")
    base = OUT / "whatif" / "truth" / f"{a.mode}-base"
    mstrace_run(base, *flags)
    b = whatif(base)
    # a run that holds its forward measures no contention (--debug-delay-ms device_compute): with
    # --contention not given, that one is predicted as if host and device never slowed each other
    k = a.contention
    for place in a.places.split(","):
        held = OUT / "whatif" / "truth" / f"{a.mode}-{place}"
        mstrace_run(held, *flags, "--debug-delay-ms", f"{place}={a.delay_ms}")
        h = whatif(held, contention=k)
        bnd = PLACE_BOUNDARY[place]
        # what the engine actually held per batch (a device hold is per forward: a round with a
        # prefill stream beside its decodes holds twice)
        rec = Trace.open(held).meta["debug_delays"][place]
        d = rec["held_ns"] / 1e6 / h.batches
        down = whatif(held, speedups=[Speedup.parse(f"{bnd}=-{d}ms")], contention=k)
        up = whatif(base, speedups=[Speedup.parse(f"{bnd}=+{d}ms")], contention=k)
        e_down = (down.predicted.cycle_ms - b.measured.cycle_ms) / d
        e_up = (up.predicted.cycle_ms - h.measured.cycle_ms) / d
        print(f"  {place:<15} held {d:.2f} ms/batch; cycle ms: base {b.measured.cycle_ms:.2f}, "
              f"held {h.measured.cycle_ms:.2f}; base from held {down.predicted.cycle_ms:.2f} ({e_down:+.2f} D); "
              f"held from base {up.predicted.cycle_ms:.2f} ({e_up:+.2f} D)", flush=True)
    print(f"load after: {load()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("modes", "comm", "truth"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="tiny")
        p.add_argument("--requests", type=int, default=128)
        p.add_argument("--cpu-device", default="thread", choices=("thread", "process"))
        p.add_argument("--extra", default="", help="extra `mstrace run` flags, space separated")
        p.add_argument("--contention", type=float, default=None,
                       help="whatif --contention (default: what each run measured at start-up)")
        if name in ("modes", "comm"):
            p.add_argument("--runs", type=int, default=5)
            p.add_argument("--reuse", action="store_true",
                           help="predict the runs an earlier call left in bench/out/whatif/ instead of running them again")
        if name == "comm":
            p.add_argument("--tp", type=int, default=2)
        if name == "truth":
            p.add_argument("--mode", default="serial", choices=("serial", "overlap"))
            p.add_argument("--delay-ms", type=float, default=5.0)
            p.add_argument("--places", default=",".join(PLACE_BOUNDARY))
    a = ap.parse_args()
    {"modes": modes, "comm": comm, "truth": truth}[a.what](a)


if __name__ == "__main__":
    main()
