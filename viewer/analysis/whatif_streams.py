"""Split streams in the model (docs/whatif.md, "Split streams").

Overlap mode's (b) runs a round's decodes on the main stream and its prefill chunks on a
stream of their own, so a prefill can run beside the decodes of its own round and of the
round before. One stream runs the round as one forward. On the CPU emulation the two streams
are two threads sharing the cores (and, on a device thread, the GIL), and each keeps a share
of its own speed while the other works (`StreamShare`, measured at start-up:
scheduler/device/contention.py); `whatif_model.two_streams` puts the parts on the clock.

From a split trace, each part's time beside the other stream is taken back to its time
alone (`parts_alone`). Between one forward and two (`converted`), a batch's device work is cut into
its decode and prefill parts by a cost fitted over the trace's own batches: a fixed cost a
forward pays once, whichever stream runs it, plus a cost per decode row and per prefill
token (`Cost`). Each batch keeps its own measured total; the fit only says how it divides
and what a second forward adds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from viewer.analysis.whatif_model import Batches, StreamShare

if TYPE_CHECKING:
    from viewer.analysis.whatif_fit import Run



def split_on(cfg: dict[str, Any], mode: str) -> bool:
    """The engine's rule (scheduler/config.py `split_on`): split streams exactly in overlap
    mode, unless --split-streams/--no-split-streams said otherwise."""
    asked = cfg.get("split_streams")
    return mode == "overlap" if asked is None else bool(asked)


def rounds_mode(cfg: dict[str, Any]) -> str:
    """How the trace's rounds ran, which is what the model replays: `overlap` where each round
    collected the batch before it (the engine's rule, scheduler/config.py `overlap_on`:
    --mode overlap unless --overlap-schedule says otherwise), else `timeslice` or `serial`.
    Read from `mode` alone, --mode overlap --no-overlap-schedule was refused as a truncated
    run, and --mode serial --overlap-schedule was replayed as serial (cycle 1.05 ms against
    0.80)."""
    mode = str(cfg.get("mode", "serial"))
    asked = cfg.get("overlap_schedule")
    if mode == "overlap" if asked is None else bool(asked):
        return "overlap"
    return "serial" if mode == "overlap" else mode


@dataclass(slots=True, frozen=True)
class Cost:
    """A forward's device time: `fixed` plus `per_decode` a decode row plus `per_prefill` a
    prefill token, ns (least squares over the trace's forwards, each coefficient >= 0)."""

    fixed: float
    per_decode: float
    per_prefill: float

    @classmethod
    def fit(cls, time: np.ndarray, decode: np.ndarray, prefill: np.ndarray) -> Cost:
        ok = time > 0
        x = np.column_stack([np.ones(int(ok.sum())), decode[ok], prefill[ok]])
        if len(x) < 3:
            return cls(0.0, 1.0, 1.0)
        coef = np.linalg.lstsq(x, time[ok], rcond=None)[0]
        if np.any(coef < 0):  # refit without the negative terms: a cost is never negative
            keep = coef >= 0
            coef = np.zeros(3)
            coef[keep] = np.linalg.lstsq(x[:, keep], time[ok], rcond=None)[0] if keep.any() else 0.0
            coef = np.maximum(coef, 0.0)
        # the fixed cost cannot be more than the cheapest forward the trace shows
        return cls(float(min(coef[0], time[ok].min())), float(coef[1]), float(coef[2]))

    def of(self, decode: np.ndarray, prefill: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.fixed + self.per_decode * decode + self.per_prefill * prefill
        return out


def _overlap(a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """Per batch, how long its part [a0, a1) ran beside the other stream's parts of the
    batches before, its own and after (the only ones a stream's order lets it meet); nan: none."""
    out = np.zeros(len(a0))
    for shift in (-1, 0, 1):
        c0, c1 = np.roll(b0, shift), np.roll(b1, shift)
        if shift:
            edge = slice(0, 1) if shift == 1 else slice(-1, None)
            c0[edge], c1[edge] = np.nan, np.nan
        out += np.nan_to_num(np.maximum(np.minimum(a1, c1) - np.maximum(a0, c0), 0.0))
    return out


def parts_alone(run: Run, b: Batches, s: StreamShare) -> Batches:
    """A split trace's parts as each would have taken alone: the time a part ran beside the
    other stream counts at the share it kept. Other traces as they are."""
    if not run.split:
        return b
    m0, m1, p0, p1 = run.parts.T
    om, op = _overlap(m0, m1, p0, p1), _overlap(p0, p1, m0, m1)
    main, pre = np.nan_to_num(m1 - m0), np.nan_to_num(p1 - p0)
    main_alone, pre_alone = main - om * (1 - s.main), pre - op * (1 - s.prefill)
    def scale(alone: np.ndarray, span: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.where(span > 0, alone / np.where(span > 0, span, 1.0), 1.0)
        return out

    # scaled, not replaced: the parts may already have lost their cold start (whatif_probe.warm)
    return replace(b, D=b.D * scale(main_alone, main), D_pre=b.D_pre * scale(pre_alone, pre))


def cost(run: Run, b: Batches) -> Cost:
    """The trace's forwards, fitted: one a batch on one stream, one a part on two."""
    if not run.split:
        return Cost.fit(b.D + b.D_pre, run.decode_tokens, run.prefill_tokens)
    zero = np.zeros(b.n)
    return Cost.fit(np.concatenate([b.D, b.D_pre]), np.concatenate([run.decode_tokens, zero]),
                    np.concatenate([zero, run.prefill_tokens]))


def converted(run: Run, b: Batches, to_split: bool) -> Batches:
    """The batches as the other stream setting would run them (alone, before any contention)."""
    if to_split == run.split:
        return b
    c = cost(run, b)
    dec, pre = run.decode_tokens > 0, run.prefill_tokens > 0
    both = dec & pre
    if to_split:  # one forward -> two: each part its fitted share, and a second fixed cost
        total = b.D + b.D_pre
        f = np.where(both, total / np.maximum(c.of(run.decode_tokens, run.prefill_tokens), 1.0), 1.0)
        main = np.where(both, f * c.of(run.decode_tokens, 0 * run.prefill_tokens), np.where(pre, 0.0, total))
        pre_part = np.where(both, f * c.of(0 * run.decode_tokens, run.prefill_tokens), np.where(pre, total, 0.0))
        return replace(b, D=main, D_pre=pre_part, T=np.maximum(b.T, 0.0))
    # two forwards -> one: the fixed cost paid once (never more than the smaller part)
    saved = np.where(both, np.minimum(c.fixed, np.minimum(b.D, b.D_pre)), 0.0)
    # one stream: the launch is done before its forward starts (a split round's first part
    # could start while its second was prepared)
    return replace(b, D=b.D + b.D_pre - saved, D_pre=np.zeros(b.n), T=np.maximum(b.T, 0.0), L=np.maximum(b.L, 0.0))
