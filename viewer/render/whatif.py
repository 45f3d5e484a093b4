"""`mstrace whatif` as text: measured, the model's fit, the prediction, and the critical path."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from viewer.analysis.whatif import Check, WhatIfResult
from viewer.analysis.whatif_model import COLD_GAP_NS
from viewer.render.text import ms, status_line, trace_heading

# (field, label, places): the report's names and units
_ROWS = (("cycle_ms", "cycle_ms", 2), ("output_tok_per_s", "output_tok_per_s", 0), ("ttft_ms_p50", "ttft_ms p50", 2),
         ("ttft_ms_p90", "ttft_ms p90", 2), ("itl_ms_p50", "itl_ms p50", 2), ("itl_ms_p90", "itl_ms p90", 2))


def _change(pred: float | None, fit: float | None) -> str:
    return "—" if not fit or pred is None else f"{100 * (pred / fit - 1):+.1f}%"


def render_whatif(console: Console, r: WhatIfResult) -> None:
    asked = ", ".join([*([f"--mode {r.target_mode}"] if r.target_mode != r.mode else []),
                       *([f"--comm-overlap {r.target_comm_overlap}"] if r.target_comm_overlap != r.comm_overlap else []),
                       *r.speedups]) or "nothing"
    status_line(console, r.status, r.trace)
    trace_heading(console, r.trace, f"  {r.mode} run, {r.batches} batches; predicted with {asked}")
    if r.window is not None:
        console.print(f"window: {r.window}; its figures count the {r.window_requests:,} requests it admitted and "
                      f"served in full, not the {r.window_requests_left_out:,} that began before it or ended "
                      "after it", highlight=False)
    t = Table(header_style="bold", title_justify="left")
    for col in ("", "measured", "model fit", "predicted", "95% interval", "vs fit"):
        t.add_column(col, justify="left" if not col else "right")
    for name, label, places in _ROWS:
        m, f, p, lo, hi = (getattr(o, name) for o in (r.measured, r.replayed, r.predicted, r.predicted_low,
                                                      r.predicted_high))
        t.add_row(label, ms(m, places), ms(f, places), ms(p, places), f"{ms(lo, places)}-{ms(hi, places)}",
                  _change(p, f))
    console.print(t)
    if isinstance(r.against, Check):
        _render_check(console, r, r.against, asked)
    if r.backend.startswith("cpu") and r.target_mode != r.mode:
        p, y = r.rates_beside_prepare, r.rates_beside_python
        console.print(f"[yellow]{r.backend}: the host and the emulated device share this machine's cores"
                      f"{' and the GIL' if r.backend == 'cpu-thread' else ''}; while both work, this prediction "
                      f"has the device keep {p.device:.2f} and the host {p.host:.2f} of their speeds beside the "
                      f"host's batch_prepare, {y.device:.2f} and {y.host:.2f} beside its other work "
                      f"({r.contention_source}; --contention K: 1-K and 1; docs/whatif.md has the errors "
                      "measured here)[/]", highlight=False)
    if r.split_streams or r.target_split_streams:
        st = r.rates_between_streams
        change = ("" if r.split_streams == r.target_split_streams
                  else " (one forward a round, cut into its decode and prefill parts by a cost fitted to the trace)"
                  if r.target_split_streams else " (the two parts merged into one forward a round)")
        console.print(f"split streams {'on' if r.split_streams else 'off'} -> "
                      f"{'on' if r.target_split_streams else 'off'}{change}; while both streams work, the main "
                      f"stream's decodes keep {st.main:.2f} and the prefill stream's chunk {st.prefill:.2f} of their "
                      f"speeds ({r.streams_source})", highlight=False)
    if r.cold_start_ms > 0 and r.target_mode != r.mode:
        console.print(f"a forward started on an idle device ({COLD_GAP_NS / 1e6:g} ms or more) takes "
                      f"{r.cold_start_ms:.2f} ms longer "
                      "than one straight after other work (measured at start-up): a serial round's every batch, "
                      "few of overlap's", highlight=False)
    if r.backend.startswith("cpu") and r.target_comm_overlap != r.comm_overlap:
        console.print(f"[yellow]{r.backend}: gloo's all-reduces run on threads that share the compute's cores; "
                      f"this prediction charges a compute segment {1 - r.rates_beside_python.device:g} of its "
                      f"overlap with the other half's all-reduce ({r.contention_source}; --contention; "
                      "docs/whatif.md has the errors measured here)[/]", highlight=False)
    target = r.target_mode
    console.print(f"critical path of the predicted {target} run, ms per round (slack: how much a row could grow "
                  "before the run does)", highlight=False)
    c = Table(header_style="bold")
    for col in ("boundary", "ms_per_round", "on_path_ms_per_round", "slack_ms_per_round"):
        c.add_column(col, justify="left" if col == "boundary" else "right")
    for row in r.critical_path:
        c.add_row(row.boundary, ms(row.ms_per_round, 3), ms(row.on_path_ms_per_round, 3),
                  ms(row.slack_ms_per_round, 3))
    console.print(c)
    console.print(f"the device waits for the host's launch before {r.host_bound_batches} of {r.batches} predicted "
                  f"batches and runs {r.device_bound_batches} straight after the batch before", highlight=False)


def _render_check(console: Console, r: WhatIfResult, c: Check, asked: str) -> None:
    console.print(f"against {c.trace}: the same workload run as predicted ({c.mode} mode; asked: {asked})",
                  highlight=False)
    t = Table(header_style="bold")
    for col in ("", "predicted", "95% interval", "measured", "error", "inside"):
        t.add_column(col, justify="left" if not col else "right")
    for name, label, places in _ROWS:
        p, lo, hi, m, e = (getattr(o, name) for o in (r.predicted, r.predicted_low, r.predicted_high, c.measured,
                                                      c.error_pct))
        inside = c.inside_interval[name]
        t.add_row(label, ms(p, places), f"{ms(lo, places)}-{ms(hi, places)}", ms(m, places),
                  "—" if e is None else f"{e:+.1f}%", "—" if inside is None else "yes" if inside else "no")
    console.print(t)
    console.print(f"{c.figures_inside} of {c.figures_checked} measured figures inside the 95% interval, which covers "
                  "both runs' rounds' variation and the start-up probe's, not the machine's drift between two runs "
                  "(docs/whatif.md)", highlight=False)
