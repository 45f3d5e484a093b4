"""What the cost table says in words: the boundaries worth attacking, and what the
device backend's emulation adds to which row."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from probes import boundaries as B
from viewer.analysis.cost import CostTable
from viewer.analysis.cycle_views import UNATTRIBUTED, _Rows
from viewer.analysis.whatif_fit import tp_pp
from viewer.analysis.whatif_gains import COMM_OVERLAP, OVERLAP, GainsWindow

# A row is worth attacking when the device waits on it at least this share of each cycle.
WORTH = 0.02
# The device is the bottleneck past this: host work is not what limits the run.
DEVICE_BOUND = 0.9
# The hop is a median: the first rows (tens of thousands of rounds) estimate it as well as
# all of a long trace's, at a fraction of the passes.
HOP_ROWS = 1 << 18

_HOST_WORK = (B.BOOKKEEPING, B.BATCH_PREPARE, B.RESPONSE_SEND)


# An imported profiler trace's rows, in words that hold for any engine.
_IMPORTED = {
    B.SCHEDULER_BARRIER: "the scheduling thread blocks on the device (a synchronising call: see `waits` by "
                         "caller); queue the next round before it syncs",
    B.DEVICE_COMM: "communication not under compute: overlap it with the other micro-batch or layer",
    B.DEVICE_COPY: "copies not under compute: pinned memory and non_blocking copies on a side stream",
    UNATTRIBUTED: "host time no mapped range covers: name the engine's phases with `--map BOUNDARY=REGEX`",
}


# Another engine's (an import or the probes API): no mstrace flag applies to it.
_FOREIGN_HOST_WORK = "host work the device waits for: overlap it with the device's (prepare round N+1 while N computes)"


def _whatif(args: str, rounds: str | None) -> str:
    """The command behind a prediction (a long trace's: over the rounds it was fitted on)."""
    return f"`mstrace whatif {'--rounds ' + rounds + ' ' if rounds else ''}{args}`"


def _remedy(name: str, mode: str | None, config: dict[str, Any], gains: dict[str, float],
            rounds: str | None = None) -> str:
    overlapped = mode == "overlap"
    # TP and PP rounds run serially or time-sliced: overlap mode is not theirs to switch on
    can_overlap = not overlapped and tp_pp(config) == (1, 1)
    if mode == "imported" and name in _IMPORTED:
        return _IMPORTED[name]
    if (mode == "imported" or "api" in config) and name in _HOST_WORK:
        return _FOREIGN_HOST_WORK
    if "api" in config and name == B.SCHEDULER_BARRIER:
        return "the scheduling thread waits for the device: queue the next round before it waits"
    if name in _HOST_WORK:
        g = gains.get(OVERLAP)
        if can_overlap and g is not None and g > -WORTH:  # e.g. host and device slowing each other (whatif)
            return (f"`--mode overlap` would not hide it here: the cycle would change {100 * g:+.1f}% "
                    f"({_whatif('--mode overlap', rounds)} says why)" if g >= WORTH else
                    f"`--mode overlap` would change the cycle by less than {100 * WORTH:.0f}% here "
                    f"({_whatif('--mode overlap', rounds)} says why)")
        return ("`--mode overlap` runs it under the device's work" if can_overlap else
                "already overlapped: this host work outlasts the device's round; make it cheaper" if overlapped
                else "TP and PP rounds run serially or time-sliced, never overlapped: make it cheaper")
    if name == B.SCHEDULER_BARRIER:
        return ("the device sits idle while the host waits for its result: launch latency or the "
                "device-process hop" + ("; `--mode overlap` keeps the next round queued" if can_overlap else ""))
    if name == B.KV_FENCE:
        return "frees wait for another stream's work: `--no-split-streams`, or free the blocks a round later"
    if name == B.PREFILL_STAGGER:
        return "a deliberate delay: lower `--prefill-stagger-us`"
    if name == B.ALL_REDUCE:
        if config.get("comm_overlap", True):
            return "communication not hidden: larger batches hide more"
        g = gains.get(COMM_OVERLAP)
        if g is None or g <= -WORTH:
            return "`--comm-overlap on` hides it behind the other half of the batch"
        return ("`--comm-overlap on` would not hide it here (below)" if g >= WORTH else
                f"`--comm-overlap on` would change the cycle by less than {100 * WORTH:.0f}% here "
                f"({_whatif('--comm-overlap on', rounds)})")
    if name == B.PP_BUBBLE:
        return "`--pp-microbatches 2` fills the pipeline"
    if name == B.DEFRAG:
        return "`--kv-layout paged` never defragments"
    if name == B.BATCH_BROADCAST:
        return "the batch description's broadcast: fewer, larger rounds"
    if name == UNATTRIBUTED:
        return "time between probes (Python overhead, the loop itself): add a probe where it goes"
    return B.REMOVABLE.get(name, "")


def _attacked(c: CostTable) -> list[tuple[str, float]]:
    """The rows the lines name, with their shares: the two largest device-idle ones."""
    rows = [(b.boundary, b.share) for b in c.boundaries
            if b.share is not None and b.boundary != B.DEVICE_COMPUTE and b.share >= WORTH]
    return rows[:2]


def attacked(c: CostTable) -> list[str]:
    """The boundaries whose halving `worth_attacking` predicts (given `gains` for them)."""
    return [name for name, _ in _attacked(c)]


def shows_window(lines: list[str], fitted: GainsWindow | None) -> bool:
    """Whether a line carries a prediction over `fitted`'s rounds (its command names them)."""
    return fitted is not None and any(f"--rounds {fitted.rounds} " in line for line in lines)


def worth_attacking(c: CostTable, mode: str | None, config: dict[str, Any],
                    gains: dict[str, float] | None = None, fitted: GainsWindow | None = None) -> list[str]:
    """One or two sentences: the largest device-idle rows, each with the option that addresses
    it and, where the round model could replay the trace (`gains`, viewer/analysis/whatif_gains.py),
    what halving it would do to the cycle; `fitted`: the rounds a long trace's `gains` are of."""
    if not c.cycles:
        return []
    gains = gains or {}
    rounds = fitted.rounds if fitted is not None else None
    lines = []
    if c.device_busy >= DEVICE_BOUND:
        lines.append(f"the device computes {100 * c.device_busy:.1f}% of each cycle: the host is not the "
                     "bottleneck (a faster model step or a larger batch is)")
    for name, share in _attacked(c):
        predicted = (f"; halved, the cycle would change {100 * gains[name]:+.1f}% "
                     f"({_whatif(f'--speedup {name}=0.5', rounds)})" if name in gains else "")
        lines.append(f"{name}: the device waits on it {100 * share:.1f}% of each cycle{predicted}; "
                     f"{_remedy(name, mode, config, gains, rounds)}")
    if COMM_OVERLAP in gains:
        g, other = gains[COMM_OVERLAP], "off" if config.get("comm_overlap", True) else "on"
        by = f"by the round model ({_whatif(f'--comm-overlap {other}', rounds)}, docs/whatif.md)"
        fixed = "each half of the batch pays the ops' fixed costs again, more than the overlap hides"
        if g <= -WORTH:
            lines.append(f"`--comm-overlap {other}`: the cycle would change {100 * g:+.1f}% {by}"
                         + (f": {fixed}" if other == "off" else ""))
        elif g >= WORTH and other == "on":
            lines.append(f"`--comm-overlap on` would not pay here: the cycle would change {100 * g:+.1f}% {by}: "
                         f"{fixed}")
    if OVERLAP in gains and gains[OVERLAP] <= -WORTH:
        lines.append(f"`--mode overlap`: the cycle would change {100 * gains[OVERLAP]:+.1f}% by the round model "
                     f"({_whatif('--mode overlap', rounds)}, docs/whatif.md)")
    if not lines:
        lines.append(f"no host boundary keeps the device idle more than {100 * WORTH:.0f}% of a cycle")
    if fitted is not None and shows_window(lines, fitted):
        lines.append(f"the round model's predictions above are of rounds {fitted.rounds}, the last {fitted.held:,} "
                     f"of the run's {fitted.of:,}: the report fits no more; `mstrace whatif --rounds A-B` or "
                     "`--time START-END` answers for any other window")
    return lines


@dataclass(slots=True)
class Backend:
    name: str  # cuda, cpu-process, cpu-thread
    emulated: bool
    hop_out_us: float | None  # device-process pipe: launch -> device starts (median)
    hop_back_us: float | None  # device done -> host has the result (median)
    notes: list[str]
    # cpu-thread: of the device threads' compute time (meta.json's run.device_stream_times),
    # the share they were ready but not running: waiting for the GIL (or a core)
    device_waiting_share: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def backend(meta: dict[str, Any], probes: pa.Table | None) -> Backend:
    """The device backend the run used and, on the CPU, what its emulation adds to which row."""
    cfg = meta.get("config", {})
    api = meta.get("api")
    if isinstance(api, dict):
        return Backend(f"{api.get('engine')} (mstrace probes API v{api.get('version')})", False, None, None, [])
    imp = meta.get("import")
    if isinstance(imp, dict):
        return Backend(f"imported {imp.get('format')}", False, None, None, [
            "the device view is the profiler's kernels, copies and collectives; the host view is the thread "
            "with the rounds: its waits on the device and the ranges --map names"])
    dev = meta.get("host", {}).get("device") or cfg.get("device", "cpu")
    if dev == "cuda":
        return Backend("cuda", False, None, None, [])
    kind = cfg.get("cpu_device", "thread")
    if kind == "process":
        out, back = _hops(probes) if cfg.get("mode") != "overlap" and probes is not None else (None, None)
        hop = (f" (median {out:.0f} us out, {back:.0f} us back)" if out is not None and back is not None else "")
        return Backend("cpu-process", True, out, back, [
            "device_compute includes building the forward batch and Python dispatch in the device process "
            "(host launch cost on a GPU)",
            f"the pipe hop to the device process{hop} is device idle charged to scheduler_barrier",
        ])
    threads = meta.get("run", {}).get("device_stream_times") or {}
    wall = sum(t.get("wall_ns", 0) for t in threads.values())
    waiting = sum(max(t.get("wall_ns", 0) - t.get("cpu_ns", 0), 0) for t in threads.values()) / wall if wall else None
    measured = ("" if waiting is None else f"; the device threads' forwards were ready but not running for {100 * waiting:.1f}% "
                "of their time (waiting for the GIL, or a core)")
    return Backend("cpu-thread", True, None, None, [
        "device streams are threads sharing the scheduler's GIL: host work can look hidden under "
        f"device_compute while it actually holds the device thread back{measured}",
    ], waiting)


def _hops(probes: pa.Table) -> tuple[float | None, float | None]:
    """Serial rounds: the batch_prepare that launched a forward ends -> the forward starts on the
    device (0 when the device started first: the payload leaves mid-prepare), and the forward
    ends -> the barrier that waited for it ends; medians over the first HOP_ROWS probe rows."""
    rows = _Rows(probes.slice(0, HOP_ROWS))
    prep_ts, prep_d = rows.get(B.BATCH_PREPARE, host_only=True)
    dev_ts, dev_d = rows.get(B.DEVICE_COMPUTE)
    bar_ts, bar_d = rows.get(B.SCHEDULER_BARRIER, host_only=True)
    if not (len(prep_ts) and len(dev_ts) and len(bar_ts)):
        return None, None
    i = np.searchsorted(prep_ts, dev_ts, side="right") - 1
    out = np.maximum(dev_ts - (prep_ts + prep_d)[np.maximum(i, 0)], 0)[i >= 0]
    dev_end, bar_end = dev_ts + dev_d, bar_ts + bar_d
    order = np.argsort(dev_end, kind="stable")
    j = np.searchsorted(dev_end[order], bar_end, side="right") - 1
    back = (bar_end - dev_end[order][np.maximum(j, 0)])[j >= 0]
    if not len(out) or not len(back):
        return None, None
    return float(np.median(out)) / 1e3, float(np.median(back)) / 1e3
