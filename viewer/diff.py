"""`mstrace diff A B`: did the change from trace A to trace B pay? Build and render."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from viewer.analysis.diff import (
    LATENCIES,
    LEVEL,
    QUANTILES,
    RESAMPLES,
    SEED,
    THROUGHPUT,
    Delta,
    diff_cycles,
    diff_requests,
    trace_warnings,
)
from viewer.report import REQUEST_COLUMNS, build_report, load_inputs


def build_diff(a_root: str | Path, b_root: str | Path, reps: int = RESAMPLES, seed: int = SEED) -> dict[str, Any]:
    """Everything `diff` shows, as plain data (what --json prints)."""
    # Both traces open first: a bad trace fails before any work.
    inputs = [load_inputs(r, [*REQUEST_COLUMNS, "dur_itl_ns"]) for r in (a_root, b_root)]
    reps_ = [build_report(inp) for inp in inputs]
    ia, ib = inputs
    warnings = [f"trace {side} is {inp.trace.status.state}: {inp.trace.status.headline()}"
                for side, inp in zip("AB", inputs, strict=True) if not inp.trace.status.complete]
    warnings += trace_warnings(ia.trace.meta, ib.trace.meta)
    cyc = diff_cycles(ia.probes, ia.steps, ib.probes, ib.steps, reps, seed, ia.collectives, ib.collectives)
    probes_ok = all(r["probes"] for r in reps_)
    for side, r in zip("AB", reps_, strict=True):
        # with --no-probes every cycle would count as barrier: no cost comparison at all
        r["device_idle"] = 1 - r["device_busy"] if probes_ok and r["cycles"] else None
        if not r["probes"]:
            warnings.append(f"trace {side} was recorded with --no-probes: no boundary or device-idle comparison")
    if not probes_ok:
        cyc["boundaries"] = {}
        cyc["device_idle"] = Delta(None, None, None, None, None, None, False)
    delta = {**cyc, **diff_requests(ia.requests, ib.requests, reps, seed)}
    return {
        "a": reps_[0],
        "b": reps_[1],
        "delta": _plain(delta),
        "warnings": warnings,
        "bootstrap": {"resamples": reps, "seed": seed, "level": LEVEL},
    }


def _plain(x: Any) -> Any:
    if isinstance(x, Delta):
        return asdict(x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


# Which way is better, for colouring significant deltas: +1 higher, -1 lower, 0 neither.
_BETTER = {"mean_ms": -1, "share": -1, "hidden": +1, "cycle_ms": -1, "device_idle": -1,
           **{k: +1 for k in THROUGHPUT}, **{k: -1 for k in LATENCIES}}


def _fmt(x: float | None, kind: str, signed: bool = False) -> str:
    if x is None:
        return "—"
    sign = "+" if signed else ""
    if kind == "pct":  # shares: values in %, deltas in percentage points
        return f"{100 * x:{sign}.1f} pp" if signed else f"{100 * x:.1f}%"
    if kind == "rate":
        return f"{x:{sign}.1f}" if abs(x) >= 10 else f"{x:{sign}.2f}"
    return f"{x:{sign}.3f}"


def _cells(d: dict[str, Any], kind: str, better: int) -> list[str]:
    mark = ""
    delta = _fmt(d["delta"], kind, signed=True)
    if d["significant"]:
        mark = "*"
        good = better * (d["delta"] or 0)
        if good:
            colour = "green" if good > 0 else "red"
            delta, mark = f"[{colour}]{delta}[/]", f"[{colour}]*[/]"
    ci = "—" if d["ci_low"] is None else f"[{_fmt(d['ci_low'], kind, True)}, {_fmt(d['ci_high'], kind, True)}]"
    return [_fmt(d["a"], kind), _fmt(d["b"], kind), delta, ci, mark]


def _table(title: str, first: list[str], la: str, lb: str) -> Table:
    t = Table(title=title, header_style="bold", title_justify="left")
    for c in first:
        t.add_column(c, no_wrap=True)
    for c in (la, lb, "Δ (B−A)", f"{LEVEL:.0%} CI"):
        t.add_column(c, justify="right", no_wrap=True)
    t.add_column("", no_wrap=True)
    return t


def render_diff(console: Console, d: dict[str, Any]) -> None:
    a, b, dl = d["a"], d["b"], d["delta"]
    la, lb = f"A {a['mode']}", f"B {b['mode']}"
    # Warnings first: a truncated, stalled or interrupted side is the first thing to know.
    for w in d["warnings"]:
        console.print(f"[yellow]warning: {escape(w)}[/]", highlight=False, soft_wrap=True)
    console.print(f"[bold]A[/] {escape(a['trace'])} (mode {a['mode']}, model {a['model']})  vs  "
                  f"[bold]B[/] {escape(b['trace'])} (mode {b['mode']}, model {b['model']})", highlight=False)

    t = _table("sync cost per boundary (device view)", ["boundary", "metric"], la, lb)
    for name, m in dl["boundaries"].items():
        for key, label, kind in (("mean_ms", "ms/cycle", "ms"), ("share", "exposed", "pct"),
                                 ("hidden", "hidden", "pct")):
            if m[key]["a"] is None and m[key]["b"] is None:
                continue
            better = 0 if name == "device_compute" else _BETTER[key]  # more compute share: neither
            t.add_row(name if key == "mean_ms" else "", label, *_cells(m[key], kind, better))
    t.add_section()
    t.add_row("cycle", "ms/cycle", *_cells(dl["cycle_ms"], "ms", _BETTER["cycle_ms"]))
    console.print(t)
    di = dl["device_idle"]
    if di["a"] is not None or di["b"] is not None:
        ca = _cells(di, "pct", _BETTER["device_idle"])
        console.print(f"device idle (1 − device busy, of cycle time): {la} {ca[0]} → {lb} {ca[1]}: "
                      f"Δ {ca[2]} {ca[3]} {ca[4]}", highlight=False, soft_wrap=True)

    t = _table("serving (bench_serving definitions)", ["metric"], la, lb)
    for key, label in (("output_tok_per_s", "output tok/s"), ("input_tok_per_s", "input tok/s"),
                       ("request_per_s", "req/s")):
        t.add_row(label, *_cells(dl["throughput"][key], "rate", _BETTER[key]))
    for lat in LATENCIES:
        t.add_section()
        for k in ("mean", *(f"p{q}" for q in QUANTILES)):
            t.add_row(f"{lat[:-3].upper()} {k} ms", *_cells(dl["latency"][lat][k], "ms", _BETTER[lat]))
    console.print(t)
    bs = d["bootstrap"]
    console.print(f"* the {bs['level']:.0%} bootstrap interval of B−A ({bs['resamples']} resamples of cycles "
                  "for cost rows, of requests for serving rows) excludes 0; green = better, red = worse",
                  highlight=False)
