"""What the report's "worth attacking" lines predict: the cycle had a row been halved, or the
run overlapped, from the round model (docs/whatif.md) without its intervals, so the report
stays one pass. Bounded: a trace of more rounds than GAINS_MAX_ROUNDS gets none (the fit reads
every probe row of rank 0 whole, which the report's stream never does); `mstrace whatif
--rounds` answers for a window of any trace."""

from __future__ import annotations

from pathlib import Path

from viewer.analysis.whatif_comm import trace_setting, with_comm_overlap
from viewer.analysis.whatif_fit import WhatIfError, load, tp_pp
from viewer.analysis.whatif_model import SCALES, Batches, busy_ns, simulate
from viewer.analysis.whatif_probe import measured, own, replayed
from viewer.analysis.whatif_share import as_run
from viewer.analysis.whatif_streams import converted, rounds_mode, split_on

GAINS_MAX_ROUNDS = 20_000
OVERLAP = "overlap mode"  # the key of a serial trace's prediction under overlap
COMM_OVERLAP = "comm overlap"  # a TP trace's, under the other --comm-overlap


def cycle_gains(root: str | Path, boundaries: list[str], mode: str | None, rounds: int) -> dict[str, float]:
    """Relative change of the mean cycle (-0.2: 20% shorter) with each boundary halved, for a
    serial run under overlap (one rank: TP and PP run serial or time-slice only), and for a
    TP run under the other --comm-overlap. Empty when the model cannot read the trace or it is
    too long."""
    if rounds > GAINS_MAX_ROUNDS or mode not in ("serial", "overlap", "timeslice"):
        return {}
    try:
        run = load(root)
    except WhatIfError:
        return {}
    cfg = run.trace.meta.get("config", {})
    mode = rounds_mode(cfg)  # how its rounds ran (--overlap-schedule may say other than --mode)
    overlap = mode == "overlap"
    point, _, _ = measured(run.trace.meta)  # the CPU emulation's host, device and streams slowing each other
    share, streams = point.share, point.streams
    alone = own(run, point, overlap)

    def cycle(b: Batches, overlapped: bool, split: bool = run.split) -> float:
        b = as_run(b, share, overlapped)
        t = simulate(b, overlapped, streams if split else None)
        return busy_ns(t) / t.rounds

    fit, tl = replayed(run, point, overlap, trace_cold=False)  # cold starts found as the predictions find them
    base = busy_ns(tl) / tl.rounds
    out = {name: cycle(alone.sped_up(name, 0.5, None), overlap) / base - 1 for name in boundaries if name in SCALES}
    if mode == "serial" and tp_pp(cfg) == (1, 1):
        split = split_on(cfg, "overlap")
        out[OVERLAP] = cycle(converted(run, alone, split), True, split) / base - 1
    setting = trace_setting(run.trace.meta)
    if setting is not None:
        try:
            other = with_comm_overlap(run, alone, setting == "off", 1 - share.python.device)
        except WhatIfError:  # no collectives table
            return out
        out[COMM_OVERLAP] = cycle(other, overlap) / base - 1
    return out
