"""The pictures of `report --html` and `diff --html`, as Plotly figures.

Plotly because its JS bundle ships inside the Python package (`plotly.offline`), so the
page carries it inline and draws with no network; a figure is plain JSON, so the same
data a test checks is what the browser draws. Each function takes one trace's tables
(ChartInputs) or two, and returns a figure; long series are reduced (quantiles for a
CDF, per-bucket maxima for a time series) so a page stays a few MB for any run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from viewer.analysis.report import CostView
    from viewer.analysis.whatif import PathRow
    from viewer.export.window import Window


@dataclass(slots=True)
class ChartInputs:
    """What the pictures read from one trace (viewer/export/html.py loads it)."""

    probes: pa.Table  # ts_ns, dur_ns, boundary, stream, rank: the rows that overlap `span`
    steps: pa.Table  # step, ts_ns, dur_ns, blocks_used, blocks_fenced, num_waiting, num_running
    requests: pa.Table  # arrival_ns, first_token_ns, finish_ns, dur_itl_ns
    span: Span | None = None  # the timeline's rounds (None: `timeline_span(steps)`)

POINTS = 1500  # at most this many points a series
WINDOW = 8  # rounds on each side of the worst one in the timeline
TIMELINE_ROUNDS = 200  # the most rounds a windowed timeline draws: a browser holds every bar
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd")
AB = ("#1f77b4", "#d62728")


def colour(boundary: str) -> str:
    """One colour per boundary on every chart of a page (the cost table's order)."""
    from viewer.analysis.cost import ORDER

    return COLOURS[ORDER.index(boundary) % len(COLOURS)] if boundary in ORDER else "#999999"


def _go() -> Any:
    import plotly.graph_objects as go

    return go


def _layout(title: str, **kw: Any) -> dict[str, Any]:
    return {"title": {"text": title}, "margin": {"l": 60, "r": 20, "t": 50, "b": 40}, "height": 360,
            "template": "plotly_white", **kw}


@dataclass(slots=True)
class Span:
    """The timeline's rounds: WINDOW on each side of the longest (indices in time order)."""

    ts: np.ndarray
    dur: np.ndarray
    step: np.ndarray
    worst: int
    lo: int
    hi: int
    in_window: int = 0  # with a window: its rounds (the timeline draws lo..hi, maybe fewer)
    # ... and how many of them lie in lo..hi: `--worst`'s rounds far apart leave rounds of
    # other parts of the trace in that stretch and the window's others out of it
    drawn_in_window: int = 0

    @property
    def t0(self) -> int:
        return int(self.ts[self.lo])

    @property
    def t1(self) -> int:
        """The last drawn round's cycle end: the next round's start (its response_send comes
        after its own end), or its end where it is the run's last."""
        end = int(self.ts[self.hi] + self.dur[self.hi])
        return max(end, int(self.ts[self.hi + 1])) if self.hi + 1 < len(self.ts) else end


def timeline_span(steps: pa.Table, window: Window | None = None) -> Span | None:
    """The rounds the timeline draws (None: no rounds, or none in `window`); only their probe
    rows are read. Without a window, WINDOW rounds on each side of the longest; with one, the
    rounds from its first to its last, or where that is more than TIMELINE_ROUNDS (a long
    window, `--worst`'s rounds far apart), the TIMELINE_ROUNDS around its longest round."""
    if not steps.num_rows:
        return None
    order = np.argsort(steps["ts_ns"].to_numpy(), kind="stable")
    ts, dur, step = (steps[c].to_numpy()[order] for c in ("ts_ns", "dur_ns", "step"))
    if window is None:
        worst = int(np.argmax(dur))
        return Span(ts, dur, step, worst, max(0, worst - WINDOW), min(len(ts) - 1, worst + WINDOW))
    inside = np.flatnonzero(window.mask(ts, ts + dur))
    if not len(inside):
        return None
    worst = int(inside[np.argmax(dur[inside])])
    lo = max(int(inside[0]), min(worst - TIMELINE_ROUNDS // 2, int(inside[-1]) - TIMELINE_ROUNDS + 1))
    hi = min(int(inside[-1]), lo + TIMELINE_ROUNDS - 1)
    drawn = int(np.count_nonzero((inside >= lo) & (inside <= hi)))
    return Span(ts, dur, step, worst, lo, hi, int(len(inside)), drawn)


def timeline(inp: ChartInputs) -> Any:
    """Stream lanes over a window of rounds around the longest one, which is shaded."""
    go = _go()
    rounds, probes = inp.span or timeline_span(inp.steps), inp.probes
    fig = go.Figure()
    if rounds is None or not probes.num_rows:
        return fig.update_layout(**_layout("timeline: no rounds"))
    ts, dur, step, worst, lo, hi = rounds.ts, rounds.dur, rounds.step, rounds.worst, rounds.lo, rounds.hi
    t0, t1 = rounds.t0, rounds.t1
    p = probes.filter(pc.and_(pc.less(probes["ts_ns"], t1), pc.greater(pc.add(probes["ts_ns"], probes["dur_ns"]), t0)))
    rank = p["rank"].to_numpy() if "rank" in p.column_names else np.zeros(p.num_rows, np.int64)
    stream = p["stream"].cast(pa.string()).to_pylist() if "stream" in p.column_names else ["?"] * p.num_rows
    lane = np.array([f"r{r} {s}" for r, s in zip(rank.tolist(), stream, strict=True)], dtype=object)
    bnd = np.array(p["boundary"].cast(pa.string()).to_pylist(), dtype=object)
    start = (p["ts_ns"].to_numpy() - t0) / 1e6
    length = p["dur_ns"].to_numpy() / 1e6
    # A row that began before the window's first round (a long wait, an idle gap) or ends
    # after its last is drawn clipped to the window; its hover gives its own start and length.
    span = (t1 - t0) / 1e6
    shown0 = np.clip(start, 0.0, span)
    shown = np.clip(start + length, 0.0, span) - shown0
    for b in sorted(set(bnd.tolist())):
        m = bnd == b
        fig.add_trace(go.Bar(x=shown[m], base=shown0[m], y=lane[m], orientation="h", name=b,
                             customdata=np.stack([start[m], length[m]], axis=1),
                             marker={"color": colour(b)}, hovertemplate=f"{b}<br>%{{customdata[0]:.3f}} ms"
                             "+ %{customdata[1]:.3f} ms<extra></extra>"))
    w0, w1 = (ts[worst] - t0) / 1e6, (ts[worst] + dur[worst] - t0) / 1e6
    # The x range is the window's own: autorange also fits the shaded round's label, which on
    # a narrow page stretched the axis far left of 0 (640 px: -50 ms to 60, half of it empty).
    # The label runs from the round's edge into the window's wider side.
    x0, x1 = 0.0, span
    pad = 0.01 * (x1 - x0)
    fig.add_vrect(x0=w0, x1=w1, fillcolor="red", opacity=0.12, line_width=0,
                  annotation_position="top left" if w0 - x0 < x1 - w1 else "top right",
                  annotation_text=f"round {int(step[worst])}: {dur[worst] / 1e6:.2f} ms (the longest)")
    return fig.update_layout(**_layout(f"timeline: rounds {int(step[lo])}-{int(step[hi])}", barmode="overlay",
                                       xaxis_title="ms", xaxis_range=[x0 - pad, x1 + pad],
                                       height=120 + 40 * len(set(lane.tolist()))))


def cost_bars(tables: list[tuple[str, CostView]]) -> Any:
    """Both views of the cost table as stacked bars, one pair of bars per trace."""
    go = _go()
    fig = go.Figure()
    names = [b.boundary for _, c in tables for b in c.boundaries]
    order = list(dict.fromkeys(names))
    x = [f"{label} {view}" for label, _ in tables for view in ("device view", "host view")]
    for b in order:
        ys = []
        for _, c in tables:
            row = c.row(b)
            device, host = (row.device_share, row.host_share) if row is not None else (None, None)
            ys += [100 * (device or 0.0), 100 * (host or 0.0)]
        if any(ys):
            fig.add_trace(go.Bar(x=x, y=ys, name=b, marker={"color": colour(b)},
                                 hovertemplate=f"{b}: %{{y:.1f}}%<extra></extra>"))
    return fig.update_layout(**_layout("where the cycle goes (share of cycle time)", barmode="stack",
                                       yaxis_title="% of cycle"))


def critical_path_bars(rows: list[PathRow], mode: str, rounds: str | None = None) -> Any:
    """Each boundary's time per round, split into what lies on the run's critical path and its
    slack (docs/whatif.md): the rows worth making faster are the long solid bars; `rounds`:
    the window a long trace's replay took (`gains_window`)."""
    go = _go()
    fig = go.Figure()
    names = [r.boundary for r in rows][::-1]  # the longest on-path row on top
    on = [r.on_path_ms_per_round for r in rows][::-1]
    slack = [r.slack_ms_per_round for r in rows][::-1]
    fig.add_trace(go.Bar(y=names, x=on, orientation="h", name="on the critical path",
                         marker={"color": [colour(n) for n in names]},
                         hovertemplate="%{y}: %{x:.3f} ms/round on the path<extra></extra>"))
    fig.add_trace(go.Bar(y=names, x=slack, orientation="h", name="slack", marker={"color": "rgba(0,0,0,0.12)"},
                         hovertemplate="%{y}: %{x:.3f} ms/round of slack<extra></extra>"))
    of = f"rounds {rounds} of the {mode} run" if rounds else f"the {mode} run"
    return fig.update_layout(**_layout(f"critical path of {of} as the round model replays it (ms per round)",
                                       barmode="stack", xaxis_title="ms per round"))


def latency_cdfs(inputs: list[tuple[str, ChartInputs]]) -> Any:
    """TTFT, ITL and E2E as CDFs, one line per trace and metric."""
    go = _go()
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT ms", "ITL ms", "E2E ms"))
    has_data = [False, False, False]
    for i, (label, inp) in enumerate(inputs):
        q = inp.requests
        arr, ft, fin = (q[c].to_numpy() for c in ("arrival_ns", "first_token_ns", "finish_ns"))
        itl = pc.list_flatten(q["dur_itl_ns"]).to_numpy(zero_copy_only=False) if "dur_itl_ns" in q.column_names \
            else np.empty(0)
        served = ft > 0  # E2E over the requests served, as the report's (serving.RequestTimes)
        for col, x in enumerate(((ft - arr)[served] / 1e6, itl / 1e6, (fin - arr)[served] / 1e6), start=1):
            xs, ys = _cdf(x)
            has_data[col - 1] |= len(xs) > 0
            # one trace: one line per panel, nothing for a legend to tell apart (its entry was blank)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=label or "requests", legendgroup=label,
                                     showlegend=col == 1 and len(inputs) > 1,
                                     line={"color": AB[i % 2] if len(inputs) > 1 else COLOURS[0]}), row=1, col=col)
    for col, ok in enumerate(has_data, start=1):
        if not ok:  # a stalled run may have no finished request: say so, not an empty axis
            fig.add_annotation(text="no data", x=0.5, y=0.5, xref="x domain", yref="y domain", showarrow=False,
                               row=1, col=col)
            fig.update_xaxes(showticklabels=False, row=1, col=col)
            fig.update_yaxes(showticklabels=False, row=1, col=col)
    return fig.update_layout(**_layout("latency CDFs", yaxis_title="fraction of requests (ITL: of gaps)"))


def kv_and_queues(inputs: list[tuple[str, ChartInputs]]) -> Any:
    """KV blocks used and fenced, requests waiting and running, over the run."""
    go = _go()
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("KV blocks", "requests"))
    for i, (label, inp) in enumerate(inputs):
        s = inp.steps
        if not s.num_rows:
            continue
        order = np.argsort(s["ts_ns"].to_numpy(), kind="stable")
        t = (s["ts_ns"].to_numpy()[order] - s["ts_ns"].to_numpy()[order][0]) / 1e9
        for col, cols in ((1, ("blocks_used", "blocks_fenced")), (2, ("num_waiting", "num_running"))):
            for k, c in enumerate(cols):
                if c not in s.column_names:
                    continue
                xs, ys = _buckets(t, s[c].to_numpy()[order])
                dash = "solid" if k == 0 else "dot"
                colour = AB[i % 2] if len(inputs) > 1 else COLOURS[2 * (col - 1) + k]
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"{label} {c}" if len(inputs) > 1 else c,
                                         line={"color": colour, "dash": dash}), row=1, col=col)
    return fig.update_layout(**_layout("KV occupancy and queues over the run", xaxis_title="s", xaxis2_title="s"))


def _cdf(x: np.ndarray) -> tuple[list[float], list[float]]:
    if not len(x):
        return [], []
    p = np.linspace(0, 1, min(POINTS, len(x)))
    return np.quantile(x, p).tolist(), p.tolist()


def _buckets(t: np.ndarray, v: np.ndarray) -> tuple[list[float], list[float]]:
    """At most POINTS points: each bucket's maximum, so a spike is never averaged away."""
    if len(t) <= POINTS:
        return t.tolist(), v.astype(float).tolist()
    edges = np.linspace(0, len(t), POINTS + 1).astype(np.int64)[:-1]
    return t[edges].tolist(), np.maximum.reduceat(v, edges).astype(float).tolist()
