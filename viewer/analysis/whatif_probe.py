"""What the engine's start-up probe measured (meta.json's `contention`; this module alone
reads it), as the model takes it: how host and device slow each other (`whatif_share`), how
the two streams do (`whatif_streams`), and a forward's cold start after an idle device. `own` turns a trace's
batches into each side's work alone with them; `rounds` gives the probe's measurements one
by one, so that the intervals carry the probe's own spread (docs/whatif.md, "Intervals")."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from viewer.analysis.whatif_fit import Run, WhatIfError
from viewer.analysis.whatif_model import Batches, StreamShare, Timeline, simulate
from viewer.analysis.whatif_share import Rates, Sharing, alone, as_run
from viewer.analysis.whatif_streams import parts_alone

NOT_MEASURED = StreamShare()  # two streams no faster together than one after the other
MIN_SHARE = 1e-3  # a stream stopped beside the other would never end


@dataclass(slots=True, frozen=True)
class Probe:
    share: Sharing  # host and device, beside the host's two kinds of work
    streams: StreamShare  # the main and prefill streams, beside each other
    cold_ns: float  # what a forward on an idle device takes longer (a device process only)


def sharing(meta: dict[str, Any], contention: float | None = None) -> tuple[Sharing, str]:
    """How host and device slow each other while both work: `--contention` when given, else
    what the engine measured at start-up (meta.json's `contention`), else not at all; and
    where that comes from, in words."""
    if contention is not None:
        if not 0 <= contention <= 1:
            raise WhatIfError(f"--contention is a share of the host's work, from 0 to 1, not {contention:g}")
        return Sharing.contention(contention), "given"
    rec = meta.get("contention")
    rec = rec if isinstance(rec, dict) else {}
    try:
        got = [(float(rec[k]["device_rate"]), float(rec[k]["host_rate"])) for k in ("prepare", "python")]
    except (KeyError, TypeError, ValueError):
        return Sharing(), f"none measured ({rec.get('why') or 'a trace from before the probe'})"
    if not all(0 <= x <= 1 for pair in got for x in pair):  # NaN too
        return Sharing(), f"none measured (meta.json's contention holds rates outside 0-1: {got})"
    return Sharing(*(Rates(*pair) for pair in got)), "measured at start-up"


def stream_share(meta: dict[str, Any]) -> tuple[StreamShare, str]:
    """The rates the engine measured at start-up (meta.json's `contention.streams`), and
    where they come from."""
    rec = meta.get("contention")
    got = rec.get("streams") if isinstance(rec, dict) else None
    if isinstance(got, dict):
        m, p = got.get("main_rate"), got.get("prefill_rate")
        if all(isinstance(x, (int, float)) and 0 <= x <= 1 for x in (m, p)):
            # a stream stopped beside the other (0) would never end: a speed too small to show
            return StreamShare(max(float(m), MIN_SHARE), max(float(p), MIN_SHARE)), "measured at start-up"  # type: ignore[arg-type]
    why = rec.get("why") if isinstance(rec, dict) and "why" in rec else "no streams record"
    return NOT_MEASURED, f"not measured ({why}): taken as no faster together than apart"


def cold_ns(meta: dict[str, Any]) -> float:
    """What a forward takes longer after an idle device, as the engine measured at start-up
    (meta.json's `contention.cold_ms`; 0 where not measured or negative). A device process
    only: on a device thread an overlap run's forwards run beside the host holding the GIL,
    and the rates beside it, measured against a forward that followed another, already
    charge that (with it, three of four thread-backend sets came out further off; the
    process backend's four of five closer: BENCHMARKS.md)."""
    if meta.get("config", {}).get("cpu_device") != "process":
        return 0.0
    rec = meta.get("contention")
    v = rec.get("cold_ms") if isinstance(rec, dict) else None
    return max(float(v), 0.0) * 1e6 if isinstance(v, (int, float)) and math.isfinite(v) else 0.0


def measured(meta: dict[str, Any], contention: float | None = None) -> tuple[Probe, str, str]:
    """The probe's medians (`--contention` replacing the host's rates), and where the host's
    and the streams' rates come from, in words."""
    share, source = sharing(meta, contention)
    streams, streams_source = stream_share(meta)
    return Probe(share, streams, cold_ns(meta)), source, streams_source


def rounds(meta: dict[str, Any], point: Probe, given: bool) -> list[Probe]:
    """The probe's measurements one by one (each rate clipped as the medians are); none where
    any is missing or the lists disagree. Host rates given by `--contention` stay as given."""
    rec = meta.get("contention")
    try:
        prep, py = rec["prepare"]["rounds"], rec["python"]["rounds"]  # type: ignore[index]
        st, cold = rec["streams"]["rounds"], rec["cold_rounds"]  # type: ignore[index]
        rows = [(*(float(x) for x in a), *(float(x) for x in b), *(float(x) for x in c), float(d))
                for a, b, c, d in zip(prep, py, st, cold, strict=True)]
    except (KeyError, TypeError, ValueError):
        return []
    if not rows or not all(len(r) == 7 and all(math.isfinite(x) for x in r) for r in rows):
        return []

    def clip(x: float) -> float:
        return min(max(x, 0.0), 1.0)

    cold_applies = meta.get("config", {}).get("cpu_device") == "process"  # as cold_ns says
    return [Probe(point.share if given else Sharing(Rates(clip(pd), clip(ph)), Rates(clip(yd), clip(yh))),
                  StreamShare(max(clip(sm), MIN_SHARE), max(clip(sp), MIN_SHARE)),
                  max(c, 0.0) * 1e6 if cold_applies else 0.0)
            for pd, ph, yd, yh, sm, sp, c in rows]


def warm(run: Run, b: Batches, cold: float) -> Batches:
    """Each part as it would take straight after other work: a cold start is the device's,
    not the part's (never more than half the part)."""
    D, D_pre = (np.where(run.cold_at[:, k], np.maximum(x - cold, x / 2), x) for k, x in ((0, b.D), (1, b.D_pre)))
    return replace(b, D=D, D_pre=D_pre, cold=cold)


def replayed(run: Run, p: Probe, overlapped: bool, trace_cold: bool = True) -> tuple[Batches, Timeline]:
    """The model's fit: the trace's batches as they ran, replayed, its cold starts where the
    trace had them; `trace_cold` False: where the replay's own gaps put them, as a prediction
    that changes something finds them, for a baseline that prediction is measured against."""
    b = as_run(own(run, p, overlapped), p.share, overlapped)
    return b, simulate(b, overlapped, p.streams if run.split else None, run.cold_at if trace_cold else None)


def own(run: Run, p: Probe, overlapped: bool) -> Batches:
    """A trace's batches as each side's work alone: its cold starts, its two streams' sharing
    (a split trace) and its host and device's (an overlap trace) taken out."""
    return alone(parts_alone(run, warm(run, run.batches, p.cold_ns), p.streams), p.share, overlapped)
