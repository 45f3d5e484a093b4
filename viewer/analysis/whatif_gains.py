"""What the report's "worth attacking" lines predict: the cycle had a row been halved, or the
run overlapped, from the round model (docs/whatif.md) without its intervals, so the report
stays one pass. Bounded: a trace of more rounds than GAINS_MAX_ROUNDS is fitted on its last
GAINS_MAX_ROUNDS (`gains_window`), as `mstrace whatif --rounds A-B` fits them, since the fit
holds its rounds' probe rows in memory, which the report's stream never does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from viewer.analysis.whatif_comm import trace_setting, with_comm_overlap
from viewer.analysis.whatif_fit import WhatIfError, load, tp_pp
from viewer.analysis.whatif_model import SCALES, Batches, busy_ns, simulate
from viewer.analysis.whatif_probe import measured, own, replayed
from viewer.analysis.whatif_share import as_run
from viewer.analysis.whatif_streams import converted, rounds_mode, split_on
from viewer.export.window import Window, last_rounds

GAINS_MAX_ROUNDS = 20_000
OVERLAP = "overlap mode"  # the key of a serial trace's prediction under overlap
COMM_OVERLAP = "comm overlap"  # a TP trace's, under the other --comm-overlap


@dataclass(frozen=True, slots=True)
class GainsWindow:
    """The rounds a long trace's predictions are fitted on: `whatif --rounds` of `rounds`."""
    window: Window
    rounds: str  # A-B, as --rounds takes it
    held: int  # rounds in it
    of: int  # the trace's


def predicts(meta: dict[str, Any]) -> bool:
    """Whether the report asks the round model about this trace: not another engine's (an
    import, the probes API), not one without probes."""
    cfg = meta.get("config", {})
    return "import" not in meta and "api" not in cfg and bool(cfg.get("probes", True))


def gains_window(steps: pa.Table) -> GainsWindow | None:
    """None where the model takes the whole trace (`steps`: its steps table with step, ts_ns
    and dur_ns); else its last GAINS_MAX_ROUNDS rounds, those nearest what a user sees when a
    long run is read."""
    cut = last_rounds(steps, GAINS_MAX_ROUNDS)
    if cut is None:
        return None
    rounds, window = cut
    return GainsWindow(window, rounds, GAINS_MAX_ROUNDS, steps.num_rows)


def cycle_gains(root: str | Path, boundaries: list[str], mode: str | None,
                window: GainsWindow | None = None) -> dict[str, float]:
    """Relative change of the mean cycle (-0.2: 20% shorter) with each boundary halved, for a
    serial run under overlap (one rank: TP and PP run serial or time-slice only), and for a
    TP run under the other --comm-overlap; over `window`'s rounds where given (`gains_window`).
    Empty when the model cannot read the trace, or it is longer than GAINS_MAX_ROUNDS and no
    window is given."""
    if mode not in ("serial", "overlap", "timeslice"):
        return {}
    try:
        # (a window is bounded already: a round touching its edge may add one row)
        run = load(root, GAINS_MAX_ROUNDS, None) if window is None else load(root, None, window.window)
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
