"""`mstrace diff A B` as text: did the change from trace A to trace B pay?

Rendering never cuts a number or drops a significance mark: the rows are laid
out as a table when the table fits the console (80 columns when piped), and
otherwise stacked, one row per line, wrapped between fields, never inside one.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape

from viewer.analysis.diff import (
    LATENCIES,
    LEVEL,
    QUANTILES,
    THROUGHPUT,
    Bootstrap,
    Delta,
    Deltas,
    DiffResult,
)
from viewer.render.text import pct, trace_heading

# Which way is better, for colouring significant deltas: +1 higher, -1 lower, 0 neither.
_BETTER = {"raw_ms_per_cycle": -1, "device_share": -1, "hidden": +1, "host_share": -1, "cycle_ms": -1, "device_idle": -1,
           **{k: +1 for k in THROUGHPUT}, **{k: -1 for k in LATENCIES}}
# Rows where more is neither better nor worse: compute, the wait for it, time no probe saw.
_NEUTRAL = ("device_compute", "scheduler_barrier", "unattributed")
_LABEL = {"raw_ms_per_cycle": ("raw ms/cycle", "ms"), "device_share": ("device share", "pct"),
          "hidden": ("hidden", "pct"), "host_share": ("host share", "pct")}
_MARK = "*"


def _fmt(x: float | None, kind: str, signed: bool = False) -> str:
    if x is None:
        return "—"
    sign = "+" if signed else ""
    if kind == "pct":  # shares: values in %, deltas in percentage points
        return f"{100 * x:{sign}.1f} pp" if signed else pct(x)
    if kind == "rate":
        return f"{x:{sign}.1f}" if abs(x) >= 10 else f"{x:{sign}.2f}"
    return f"{x:{sign}.3f}"


@dataclass(slots=True)
class Row:
    """One rendered delta: plain-text cells (their widths are what is laid out) and a colour."""

    label: str
    a: str
    b: str
    delta: str
    ci: str
    mark: str  # _MARK or ""
    colour: str | None  # for delta and mark: green better, red worse
    group: str | None = None  # a heading printed above this row (the boundary)


def _row(label: str, d: Delta, kind: str, better: int, group: str | None = None) -> Row:
    colour = None
    if d.significant:
        good = better * (d.delta or 0)
        colour = ("green" if good > 0 else "red") if good else None
    ci = "—" if d.ci_low is None else f"[{_fmt(d.ci_low, kind, True)}, {_fmt(d.ci_high, kind, True)}]"
    return Row(label, _fmt(d.a, kind), _fmt(d.b, kind), _fmt(d.delta, kind, signed=True), ci,
               _MARK if d.significant else "", colour, group)


def sections(dl: Deltas) -> list[tuple[str, list[Row]]]:
    """The deltas as the text prints them (labels, units, pp for shares): also the HTML page's."""
    cost: list[Row] = []
    for name, m in dl.boundaries.items():
        first = True
        for key, d in m.items():
            if d.a is None and d.b is None:
                continue
            label, kind = _LABEL[key]
            better = 0 if name in _NEUTRAL else _BETTER[key]
            cost.append(_row("  " + label, d, kind, better, name if first else None))
            first = False
    cost.append(_row("  ms/cycle", dl.cycle_ms, "ms", _BETTER["cycle_ms"], "cycle"))
    di = dl.device_idle
    if di.a is not None or di.b is not None:
        cost.append(_row("device idle", di, "pct", _BETTER["device_idle"], ""))
    serving = [_row(label, dl.throughput[key], "rate", _BETTER[key])
               for key, label in (("output_tok_per_s", "output tok/s"), ("input_tok_per_s", "input tok/s"),
                                  ("request_per_s", "req/s"))]
    for lat in LATENCIES:
        for i, k in enumerate(("mean", *(f"p{q}" for q in QUANTILES))):
            serving.append(_row(f"  {k} ms", dl.latency[lat][k], "ms", _BETTER[lat],
                                lat[:-3].upper() if i == 0 else None))
    return [("sync cost per boundary", cost), ("serving (bench_serving definitions)", serving)]


def _paint(text: str, colour: str | None) -> str:
    return f"[{colour}]{escape(text)}[/]" if colour and text else escape(text)


def _widths(rows: list[Row], la: str, lb: str, two_line: bool = False) -> tuple[list[int], int]:
    """Column widths of a table layout and its total width (group headings included).
    two_line: each row's interval goes on a line of its own, under the row."""
    head = Row("", la, lb, "Δ (B−A)", f"{LEVEL:.0%} CI", "", None)
    w = [max(cell_len(getattr(r, f)) for r in (head, *rows)) for f in ("label", "a", "b", "delta", "ci")]
    total = sum(w[:4]) + 2 + 2 + 2 + 2  # gaps, and " *" after the delta
    if two_line:
        total = max(total, 2 + w[4] + 3)  # "CI " + the interval, indented
    else:
        total += 1 + w[4]
    return w, max(total, *(cell_len(r.group) for r in rows if r.group))


def _table(console: Console, title: str, rows: list[Row], la: str, lb: str, two_line: bool = False) -> None:
    """The rows as a table (the caller checked that it fits)."""
    w, total = _widths(rows, la, lb, two_line)
    head = Row("", la, lb, "Δ (B−A)", "" if two_line else f"{LEVEL:.0%} CI", "", None)

    def line(r: Row, paint: bool = True) -> str:
        cells = escape("  ".join((r.label.ljust(w[0]), r.a.rjust(w[1]), r.b.rjust(w[2]))))
        dlt, mark = r.delta.rjust(w[3]), (r.mark or " ")
        ci = "" if two_line else " " + escape(r.ci.rjust(w[4]))
        if not paint:
            return f"{cells}  {escape(dlt)} {mark}{ci}".rstrip()
        return f"{cells}  {_paint(dlt, r.colour)} {_paint(mark, r.colour)}{ci}".rstrip()

    console.print(f"[bold]{escape(title)}[/]", highlight=False, soft_wrap=True)
    console.print(f"[bold]{line(head, paint=False)}[/]", highlight=False, soft_wrap=True)
    console.print("─" * total, highlight=False, soft_wrap=True)
    for r in rows:
        if r.group is not None:
            console.print(escape(r.group), highlight=False, soft_wrap=True)
        console.print(line(r), highlight=False, soft_wrap=True)
        if two_line:  # the interval under its row, ending under the delta
            ci = f"{LEVEL:.0%} CI {r.ci}"
            console.print(escape(ci.rjust(max(total - 2, cell_len(ci) + 4))), highlight=False, soft_wrap=True)


def _stacked(console: Console, title: str, rows: list[Row]) -> None:
    """One row per line, wrapped between fields (never inside one) when the console is narrow."""
    console.print(f"[bold]{escape(title)}[/]", highlight=False, soft_wrap=True)
    for r in rows:
        if r.group is not None:
            console.print(escape(r.group), highlight=False, soft_wrap=True)
        fields = [(r.label, escape(r.label)), (f"A {r.a}", escape(f"A {r.a}")), (f"B {r.b}", escape(f"B {r.b}")),
                  (f"Δ {r.delta}" + (f" {r.mark}" if r.mark else ""),
                   "Δ " + _paint(r.delta, r.colour) + (" " + _paint(r.mark, r.colour) if r.mark else "")),
                  (f"CI {r.ci}", escape(f"CI {r.ci}"))]
        plain, out = "", ""
        for text, markup in fields:
            if plain and cell_len(plain) + 2 + cell_len(text) > console.width:
                console.print(out, highlight=False, soft_wrap=True)
                plain, out = "      ", "      "  # continuation lines, indented under the label
            elif plain:
                plain, out = plain + "  ", out + "  "
            plain, out = plain + text, out + markup
        console.print(out, highlight=False, soft_wrap=True)


def render_diff(console: Console, d: DiffResult) -> None:
    a, b, dl, bs = d.a, d.b, d.delta, d.bootstrap
    la, lb = f"A {a.mode}", f"B {b.mode}"
    # Warnings first: a truncated, stalled or interrupted side is the first thing to know.
    for w in d.warnings:
        console.print(f"[yellow]warning: {escape(w)}[/]", highlight=False, soft_wrap=True)
    for side, r in (("A", a), ("B", b)):
        trace_heading(console, r.trace, f" (mode {r.mode}, model {r.model})", lead=f"{side} ")
    parts = sections(dl)
    # the widest layout that fits: a table, a table with each interval under its row,
    # or every field stacked (all sections alike, so they read alike)
    for two_line in (False, True):
        if all(_widths(rows, la, lb, two_line)[1] <= console.width for _, rows in parts):
            for title, rows in parts:
                _table(console, title, rows, la, lb, two_line)
            break
    else:
        console.print(f"{la} → {lb}; Δ = B − A; CI = {LEVEL:.0%} interval of Δ", highlight=False)
        for title, rows in parts:
            _stacked(console, title, rows)
    console.print(_footnote(bs), highlight=False)


def _footnote(bs: Bootstrap) -> str:
    rs = bs.resampling
    cyc, req = rs.get("cycles", {}), rs.get("requests", {})
    ca, cb = cyc.get("a", {}), cyc.get("b", {})
    if req.get("paired"):
        how = f"requests paired by id (same workload: the same {req['n']} requests drawn for A and B)"
    else:
        how = f"requests drawn independently for A and B ({req.get('why', 'not paired')})"
    how += ", their times scaled by each run's resampled rounds"
    fd = bs.fdr
    return (f"{_MARK} = significant: Benjamini-Hochberg, false discovery rate {fd.q} over the {fd.rows} rows "
            f"with an interval (two-sided bootstrap p-values); green = better, red = worse.\n"
            f"The {bs.level:.0%} intervals ({bs.resamples} resamples) cover the noise within these two runs, "
            f"not run-to-run variation: cycles and rounds resampled in circular blocks (A: {ca.get('n', 0)} "
            f"cycles, blocks of {ca.get('block', 1)}; B: {cb.get('n', 0)}, blocks of {cb.get('block', 1)}), "
            f"{how}. A rerun of the same command can differ by more; alternated pairs (bench/) say whether a "
            f"change pays.")
