"""`mstrace report TRACE --html OUT.html` and `mstrace diff A B --html OUT.html`.

One self-contained file: the text report's tables as HTML, and the pictures of
viewer/export/html_charts.py drawn by Plotly's JS, which is inlined, so the page
needs no network when it is opened. The page records what happened as it drew: the
`data-drawn` attribute of <body> counts the charts drawn, `data-errors` holds any
script error (tests/test_html.py opens it in headless Chromium and reads both).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracing.consistency import probe_clip, read_consistent
from tracing.reader import Trace
from tracing.schema import TABLES
from viewer.analysis.records import JsonView
from viewer.analysis.whatif import replayed_path
from viewer.analysis.whatif_gains import gains_window
from viewer.export import html_charts as charts
from viewer.export.window import Window, parse_window, table_in
from viewer.render.text import ms, pct

if TYPE_CHECKING:
    from viewer.analysis.diff import DiffResult
    from viewer.analysis.report import CostView, Latency, ReportResult

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; margin: 8px 0; }
td, th { padding: 3px 10px; border-bottom: 1px solid #ddd; text-align: right; }
td:first-child, th:first-child { text-align: left; }
tr.sig td { font-weight: 600; } .note { color: #666; } .warn { color: #b00; font-weight: 600; } .chart { min-height: 200px; }
html { scrollbar-gutter: stable; } h1, p { overflow-wrap: anywhere; }
td:not(:first-child) { white-space: nowrap; } td.ci { white-space: normal; }
.wide { overflow-x: auto; }
@media (max-width: 720px) { body { margin: 12px; } td, th { padding: 3px 6px; } }
"""
# A narrow window (tests/test_html.py: 640 px) cuts nothing off: a trace's path wraps
# anywhere rather than run past the edge; a value keeps its unit on its line ("+23.3 pp",
# not "+23.3" over "pp"), a CI breaks after its comma only; a table still wider than the
# window scrolls in its own box (.wide), not the page. The scroll bar's room is kept from
# the start: a chart takes the page's width as it draws, and a bar that came after (the page
# grown by the charts) pushed the charts past the window's edge.
ERRORS = ("window.__errors=[];window.addEventListener('error',function(e){window.__errors.push(String(e.message));"
          "document.body&&(document.body.dataset.errors=window.__errors.join(' | '));});")


PROBE_COLUMNS = ["ts_ns", "dur_ns", "boundary", "stream", "rank"]


def chart_inputs(root: str | Path, window: Window | None = None) -> charts.ChartInputs:
    """The steps and requests, and only the probe rows the timeline draws: a long trace's
    probe rows are never all read (their row groups' statistics skip the rest)."""
    trace = Trace.open(root)
    t = read_consistent(trace, {
        "steps": ["step", "ts_ns", "dur_ns", "blocks_used", "blocks_fenced", "num_waiting", "num_running"],
        "requests": ["arrival_ns", "first_token_ns", "finish_ns", "dur_itl_ns"]})
    span = charts.timeline_span(t["steps"], window)
    clip = probe_clip(trace, t["steps"])
    cols = [*PROBE_COLUMNS, "step"] if clip is not None else PROBE_COLUMNS
    probes = TABLES["probes"].empty_table().select(PROBE_COLUMNS)
    if span is not None and trace.has_table("probes"):
        probes = table_in(trace, "probes", cols, Window(((span.t0, span.t1),), "the timeline's rounds"))
        probes = clip(probes) if clip is not None else probes
    return charts.ChartInputs(probes, t["steps"], t["requests"], span)


def report_html(root: str | Path, out: str | Path, rep: ReportResult | None = None,
                window: Window | None = None) -> None:
    """`window` (`report --rounds/--time/--request/--worst`) chooses the rounds the timeline
    draws; the tables and the other pictures are the whole trace's."""
    from viewer.analysis.report import build_report

    rep = rep if rep is not None else build_report(root)
    inp = chart_inputs(root, window)
    figs = [charts.cost_bars([("", rep.cost)]), charts.timeline(inp), charts.latency_cdfs([("", inp)]),
            charts.kv_and_queues([("", inp)])]
    # the rounds the report's predictions are of, where it made some (the same rounds on a trace
    # still being written), else a long trace's last ones
    fitted = gains_window(inp.steps)
    rounds = rep.worth_attacking_rounds or (fitted.rounds if fitted is not None else None)
    at = (fitted.window if fitted is not None and fitted.rounds == rounds else  # (the steps read once)
          parse_window(Trace.open(root), rounds=rounds) if rounds else None)
    path = replayed_path(root, at)  # None for an imported or a TP/PP trace
    if path:
        figs.insert(1, charts.critical_path_bars(path, rep.mode or "traced", rounds))
    body = [f"<h1>mstrace report: {_e(rep.trace)}</h1>", *_status(rep), _facts(rep),
            *([f"<p class=note>{_e(timeline_note(window, inp))}</p>"] if window is not None else []),
            "<h2>Sync cost</h2>",
            *([_cost_table(rep.cost), *_worth(rep)] if rep.probes else
              ["<p class=note>this trace was recorded with --no-probes: no cost table</p>"]),
            *_backend_notes(rep),
            "<h2>Throughput and latency</h2>",
            _latency_table(rep.latency)]
    _write(out, f"mstrace report {rep.trace}", body, figs)


def timeline_note(window: Window, inp: charts.ChartInputs) -> str:
    """What a windowed page's timeline shows and what it leaves out."""
    span, rounds = inp.span, inp.steps.num_rows
    if span is None:
        return f"Timeline window: {window.what}: no round of the trace's {rounds} is in it; the timeline is empty."
    drawn = span.hi - span.lo + 1
    cut = (f"; {span.in_window - span.drawn_in_window} of the window's rounds left out (a timeline draws "
           f"{charts.TIMELINE_ROUNDS} consecutive rounds at most: `mstrace export --perfetto` with the same "
           "window has them all)" if span.in_window > span.drawn_in_window else "")
    return (f"Timeline window: {window.what}: rounds {int(span.step[span.lo])}-{int(span.step[span.hi])} drawn "
            f"({drawn} rounds, {inp.probes.num_rows} probe rows; the window holds {span.in_window} of the trace's "
            f"{rounds} rounds){cut}. The tables and the other pictures are the whole trace's.")


def diff_html(a: str | Path, b: str | Path, out: str | Path, d: DiffResult | None = None) -> None:
    from viewer.analysis.diff import build_diff

    d = d if d is not None else build_diff(a, b)
    ia, ib = chart_inputs(a), chart_inputs(b)
    figs = [charts.cost_bars([("A", d.a.cost), ("B", d.b.cost)]), charts.latency_cdfs([("A", ia), ("B", ib)]),
            charts.kv_and_queues([("A", ia), ("B", ib)])]
    body = [f"<h1>mstrace diff</h1><p>A: {_e(d.a.trace)} ({_e(d.a.mode)})<br>"
            f"B: {_e(d.b.trace)} ({_e(d.b.mode)})</p>",
            *(f"<p class=note>{_e(w)}</p>" for w in d.warnings),
            ]
    _write(out, "mstrace diff", body, figs, ["<h2>B - A, significant deltas first</h2>", _delta_table(d)])


# ---- the page ------------------------------------------------------------------------------
def _write(out: str | Path, title: str, body: list[str], figs: list[Any], after: list[str] | None = None) -> None:
    from plotly.offline import get_plotlyjs

    divs = [f'<div class="chart" id="chart{i}"></div>' for i in range(len(figs))]
    data = "{" + ",".join(f'"chart{i}":{f.to_json()}' for i, f in enumerate(figs)) + "}"
    draw = ("var figs=" + data.replace("</", "<\\/") + ";var ids=Object.keys(figs);"
            "Promise.all(ids.map(function(id){return Plotly.newPlot(id,figs[id].data,figs[id].layout,"
            "{displaylogo:false,responsive:true});})).then(function(){document.body.dataset.drawn=ids.length;})"
            ".catch(function(e){window.__errors.push(String(e));document.body.dataset.errors=window.__errors.join(' | ');});")
    page = (f"<!doctype html><html><head><meta charset=utf-8><title>{_e(title)}</title><style>{STYLE}</style>"
            f"<script>{ERRORS}</script><script>{get_plotlyjs()}</script></head>"
            f'<body data-charts="{len(figs)}" data-drawn="0" data-errors="">'
            + "\n".join(body) + "<h2>Pictures</h2>" + "\n".join(divs) + "\n".join(after or [])
            + f"<script>{draw}</script></body></html>")
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _ci(ci: Any) -> str:
    """"[-9.5 pp, -3.1 pp]": each end whole, a line break only after the comma."""
    return ", ".join(_e(end).replace(" ", "&nbsp;") for end in str(ci).split(", "))


def _wide(table: str) -> str:
    """A table in a box of its own that scrolls sideways when the window is narrower."""
    return f"<div class=wide>{table}</div>"


def _facts(rep: ReportResult) -> str:
    t, c = rep.throughput, rep.cost
    # as the text report: the choice is said where auto made it
    why = f" ({_e(rep.dtype_choice)})" if rep.dtype_choice and rep.dtype_choice != "asked" else ""
    dtype = f", dtype {_e(rep.dtype)}{why}" if rep.dtype else ""
    pack = rep.weight_pack_choice
    dtype += f", weight pack {_e(pack)}" if pack and pack.startswith("auto") else ""
    dtype += f", pages {_e(rep.pages)}" if rep.pages else ""
    dtype += f", oneDNN primitive cache {_e(rep.primitive_cache)}" if rep.primitive_cache else ""
    # the device's share only where probes measured it (a --no-probes trace has no device rows)
    busy = f"; the device computes {pct(c.device_busy)} of it" if rep.probes and c.cycles else ""
    return (f"<p>model {_e(rep.model)}, mode {_e(rep.mode)}{dtype}, {_e(rep.status.state)}; "
            f"{c.cycles} cycles of {ms(c.cycle_ms)} ms{busy}. {t.completed}/{t.requests} requests in "
            f"{t.duration_s:.2f} s: {t.output_tok_per_s:.1f} output tok/s.</p>")


def _cost_table(c: CostView) -> str:
    rows = "".join(f"<tr><td>{_e(b.boundary)}</td><td>{ms(b.device_ms_per_cycle)}</td>"
                   f"<td>{pct(b.device_share)}</td><td>{ms(b.host_ms_per_cycle)}</td>"
                   f"<td>{pct(b.host_share)}</td><td>{b.count}</td><td>{pct(b.hidden)}</td></tr>"
                   for b in c.boundaries)
    return _wide("<table><tr><th>boundary</th><th>device ms/cycle</th><th>device share</th><th>host ms/cycle</th>"
                 f"<th>host share</th><th>count</th><th>hidden</th></tr>{rows}</table>")


def _status(rep: JsonView) -> list[str]:
    """An incomplete trace's line, as the text report's first line (a stalled run: where to look).
    `rep`: the report or its JSON (either reads by key)."""
    from tracing.run_status import RunStatus

    line = RunStatus(**rep["status"]).headline()
    if line is None:
        return []
    if rep["status"]["state"] == "stalled":
        line += f"; see `mstrace stalls {rep['trace']}` for the waits, the wait-for graph and the stacks"
    return [f"<p class=warn>{_e(line)}</p>"]


def _worth(rep: JsonView) -> list[str]:
    """`rep`: the report or its JSON (either reads by key)."""
    # the text's `code` spans as <code>, not literal backticks
    code, sub = re.compile(r"`([^`]*)`"), r"<code>\g<1></code>"
    lines = [code.sub(sub, _e(w if isinstance(w, str) else json.dumps(w))) for w in rep["worth_attacking"] or []]
    return [f"<p class=note>worth attacking: {line}</p>" for line in lines]


def _backend_notes(rep: ReportResult) -> list[str]:
    """What the device's emulation adds to which row, as the text report says it under its table."""
    be = rep.backend
    how = " (emulated)" if be.emulated else ""
    return [f"<p class=note>{_e(be.name)}{how}: {_e(note)}</p>" for note in be.notes]


def _latency_table(lat: Latency) -> str:
    rows = "".join(f"<tr><td>{_e(k)}</td>" + "".join(f"<td>{ms(x)}</td>" for x in (v.mean, v.p50, v.p90, v.p99))
                   + "</tr>" for k, v in lat.items())
    return _wide(f"<table><tr><th>metric</th><th>mean</th><th>p50</th><th>p90</th><th>p99</th></tr>{rows}</table>")


def _delta_table(d: DiffResult) -> str:
    """The text diff's rows (its labels and units: ms, pp, %), significant ones first."""
    from viewer.render.diff import sections

    rows: list[tuple[str, Any]] = []
    for _, section in sections(d.delta):
        group = ""
        for r in section:
            group = r.group if r.group is not None else group
            rows.append((f"{group} {r.label.strip()}".strip(), r))
    rows.sort(key=lambda x: not x[1].mark)  # stable: within each kind, the text's order
    html_rows = "".join(
        f"<tr class={'sig' if r.mark else 'ns'}><td>{_e(name)}</td><td>{_e(r.a)}</td><td>{_e(r.b)}</td>"
        f"<td>{_e(r.delta)}</td><td class=ci>{_ci(r.ci)}</td><td>{'yes' if r.mark else 'no'}</td></tr>" for name, r in rows)
    return _wide("<table><tr><th>metric</th><th>A</th><th>B</th><th>B - A</th><th>95% CI</th><th>significant</th></tr>"
                 f"{html_rows}</table>")
