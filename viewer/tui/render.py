"""`TopView` (viewer/live/state.py) as rich text: the pieces `mstrace top` shows.

Pure functions of the view and a width, so a test can check what a panel says
without a terminal, and the app only places them.
"""

from __future__ import annotations

from rich.text import Text

from probes import boundaries as B
from viewer.analysis.cycle_views import UNATTRIBUTED
from viewer.live.state import Lane, TopView
from viewer.render.text import ms, pct

# One colour per boundary, the same in every panel; the letter stands in where colour is lost.
COLOURS: dict[str, tuple[str, str]] = {
    B.DEVICE_COMPUTE: ("green", "C"),
    B.SCHEDULER_BARRIER: ("red", "W"),
    B.ALL_REDUCE: ("magenta", "A"),
    B.BOOKKEEPING: ("yellow", "K"),
    B.RESPONSE_SEND: ("cyan", "S"),
    B.RESPONSE_DELIVER: ("bright_cyan", "D"),
    B.BATCH_BROADCAST: ("bright_magenta", "B"),
    B.KV_FENCE: ("bright_red", "F"),
    B.TOKENIZE: ("blue", "T"),
    B.BATCH_PREPARE: ("bright_yellow", "P"),
    B.STREAM_WAIT: ("orange3", "w"),
    B.PREFILL_STAGGER: ("grey50", "g"),
    B.DEFRAG: ("bright_white", "d"),
    B.PP_BUBBLE: ("purple", "b"),
    UNATTRIBUTED: ("white", "?"),
}
SPARK = "▁▂▃▄▅▆▇█"


def colour(boundary: str) -> str:
    return COLOURS.get(boundary, ("white", "?"))[0]


def header(v: TopView, paused: bool = False) -> Text:
    st = v.status
    state = "running" if st.state == "truncated" and st.live else st.state
    t = Text()
    t.append(f"{v.model}", style="bold")
    started = v.last_step >= 0
    t.append(f"  mode {v.mode}  {v.backend}  " + (f"up {v.uptime_s:,.0f}s  round {v.last_step}\n" if started
                                                  else "up -  round -\n"))
    t.append(f"{v.req_per_s:.1f} req/s  {v.decode_tok_per_s:,.0f} decode tok/s  ")
    t.append(f"running {v.running}  waiting {v.waiting}  finished {v.finished}  ")
    if state == "running" and not started:  # the trace is there, its first round is not: the engine starts
        t.append("STARTING: loading the model, no round yet", style="bold yellow")
    else:
        t.append(state.upper() if state != "running" else "live", style="bold green" if state == "running"
                 else "bold red" if state in ("stalled", "error") else "bold yellow")
    if paused:
        t.append("  PAUSED", style="reverse")
    return t


def banner_waiting(why: str) -> Text:
    return Text(why, style="bold yellow")


def banner(v: TopView, note: str | None = None) -> Text | None:
    """The stall, leak or end-of-run line (`note`: what the run's process did), or None
    when all is well."""
    if v.stalls:
        # the first noticed, as `mstrace stalls` numbers them (stall 1 is often the cause of
        # the rest); rows come rank by rank, so the list's last is not even the newest
        s = min(v.stalls, key=lambda r: (r["ts_ns"], r["rank"]))
        more = f" (+{len(v.stalls) - 1} more: mstrace stalls)" if len(v.stalls) > 1 else ""
        cyc = f"; wait cycle: {s['cycle']}" if s.get("cycle") else ""
        return Text(f"STALL at round {s['step']}: {s['waiter']} waited {s['waited_ns'] / 1e9:.1f} s on {s['what']} "
                    f"({s['signaller']}){cyc}{more}", style="bold white on red")
    if v.leaks:
        rid, n = v.leaks[0]
        more = f" (+{len(v.leaks) - 1} more)" if len(v.leaks) > 1 else ""
        return Text(f"SUSPECTED LEAK: {rid} finished but still holds {n} blocks{more}", style="bold black on yellow")
    if note is not None:
        return Text(note, style="bold yellow")
    if v.status.state != "truncated" or not v.status.live:
        head = v.status.headline() or "the run is complete"
        return Text(f"{head}; the view shows its last state (q quits)", style="bold yellow")
    return None


def lanes(v: TopView, width: int, cursor: float | None = None) -> Text:
    """One strip per stream and rank over the window; `cursor` (0..1) marks a time."""
    name_w = max([len(ln.name) for ln in v.lanes] + [6]) + 1
    cur_w = 18
    strip = max(8, width - name_w - cur_w - 2)
    t = Text()
    span = (v.t1_ns - v.t0_ns) / 1e9
    t.append(f"{'lanes':<{name_w}}", style="bold")
    t.append(f"last {span:.2f} s".ljust(strip), style="dim")
    t.append(" now\n", style="dim")
    if not v.lanes:
        t.append("(no probe rows in the window)", style="dim")
        return t
    col = None if cursor is None else min(strip - 1, max(0, int(cursor * strip)))
    for ln in v.lanes:
        t.append(f"{ln.name:<{name_w}}")
        cells = ln.cells(v.t0_ns, v.t1_ns, strip)
        i = 0
        while i < len(cells):  # one span per run of a boundary: a redraw's cost is its spans
            b = cells[i]
            j = i + 1
            while j < len(cells) and cells[j] == b and j != col and i != col:
                j += 1
            style = f"black on {colour(b)}" if b else ""
            if i == col:
                style = f"{style} reverse".strip()
            t.append((COLOURS.get(b, ("", "?"))[1] if b else " ") * (j - i), style=style)
            i = j
        now = (ln.current if ln.busy else "-")[:cur_w - 1]
        t.append(f" {now:<{cur_w - 1}}", style=colour(ln.current) if ln.busy else "dim")
        t.append("\n")
    at = 0
    for b in lane_legend(v):  # wrapped here, so its height is known before a paint (lanes_rows)
        if at and at + len(b) + 4 > width:
            t.append("\n")
            at = 0
        t.append(f" {COLOURS.get(b, ('', '?'))[1]} ", style=f"black on {colour(b)}")
        t.append(f"{b} ")
        at += len(b) + 4
    return t


def lane_legend(v: TopView) -> list[str]:
    return sorted({b for ln in v.lanes for b in ln.boundary})


def lanes_rows(v: TopView, width: int) -> int:
    """How many lines `lanes(v, width)` draws."""
    if not v.lanes:
        return 2
    rows, at = 2, 0
    for b in lane_legend(v):
        if at and at + len(b) + 4 > width:
            rows, at = rows + 1, 0
        at += len(b) + 4
    return rows + len(v.lanes)


def lane_round(v: TopView, cursor: float) -> int | None:
    """The round whose rows are under the cursor (the main lane's, else any)."""
    at = v.t0_ns + cursor * (v.t1_ns - v.t0_ns)
    best: tuple[int, Lane] | None = None
    for ln in v.lanes:
        inside = (ln.start <= at) & (ln.end > at)
        if inside.any():
            rank = 0 if ln.stream == "main" else 1
            if best is None or rank < best[0]:
                best = (rank, ln)
    if best is None:
        return None
    ln = best[1]
    i = int((ln.start <= at).nonzero()[0][-1])
    return int(ln.step[i])


def cost(v: TopView, width: int = 80) -> Text:
    """The rolling cost table as fixed-width text: a rich Table measured its columns on
    every redraw, a third of a refresh's time. Narrow, the `hidden` column goes first."""
    t = Text()
    t.append(f"sync cost, last {v.cost_rounds} rounds\n", style="italic")
    c = v.cost
    if c is None or not c.cycles:
        t.append("(no whole round yet)", style="dim")
        return t
    hidden = width >= 12 + 35
    name_w = max(10, min(22, width - (35 if hidden else 26)))
    t.append(f"{'boundary':<{name_w}}{'dev ms':>8}{'device':>9}{'host':>9}" + (f"{'hidden':>9}" if hidden else "")
             + "\n", style="bold")
    for b in c.boundaries:
        if b.share is None and b.host_share is None and not b.count:
            continue
        name = b.boundary if len(b.boundary) <= name_w - 1 else b.boundary[: name_w - 2] + "…"
        t.append(f"{name:<{name_w}}", style="bold reverse" if b.boundary == v.worst else colour(b.boundary))
        dev_ms = ms(None if b.share is None else b.share * c.cycle_ms, missing="-")  # device ms/cycle, as `report` prints it
        t.append(f"{dev_ms:>8}{pct(b.share, '-'):>9}{pct(b.host_share, '-'):>9}"
                 + (f"{pct(b.hidden, '-'):>9}" if hidden else "") + "\n")
    t.append(f"{'cycle':<{name_w}}", style="bold")
    t.append(f"{c.cycle_ms:>8.2f}{'100%':>9}{'100%':>9}")
    return t


def sparkline(series: list[float], width: int) -> str:
    xs = series[-width:]
    if not xs:
        return ""
    lo, hi = min(xs), max(xs)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((x - lo) / span * (len(SPARK) - 1) + 0.5))] for x in xs)


def latency(v: TopView, width: int) -> Text:
    t = Text()
    t.append("latency, ms\n", style="bold")
    spark_w = width - 29  # one line a metric: the sparkline fills what the numbers leave
    for lat in v.latency:
        t.append(f"{lat.name:<5} p50 {ms(lat.p50_ms, None, '-'):>6} p99 {ms(lat.p99_ms, None, '-'):>6} ")
        if spark_w >= 4:
            t.append(sparkline(lat.series, spark_w), style="cyan")
        t.append("\n")
    return t


def kv(v: TopView, width: int) -> Text:
    t = Text()
    t.append("KV pool\n", style="bold")
    k = v.kv
    if k is None or not k.capacity:
        t.append("(no round yet)", style="dim")
        return t
    bar_w = max(10, width - 2)
    live = max(0, k.used - k.fenced)
    n_live = round(bar_w * live / k.capacity)
    n_fence = round(bar_w * k.fenced / k.capacity)
    t.append("█" * n_live, style="green")
    t.append("█" * n_fence, style="red")
    t.append("░" * max(0, bar_w - n_live - n_fence), style="grey35")
    t.append(f"\nused {k.used} (fenced {k.fenced})  free {k.free}  of {k.capacity}\n")
    frag = "-" if k.largest_free_run is None or not k.free else f"{1 - k.largest_free_run / k.free:.0%}"
    hit = "-" if k.prefix_hit_rate is None else f"{k.prefix_hit_rate:.0%}"
    t.append(f"fragmentation {frag}  prefix hits {hit}\n")
    if k.holders:
        t.append("top holders" + ("" if k.exact else " (since attach)") + ": ", style="dim")
        t.append(", ".join(f"{rid[-10:]} {n}" for rid, n in k.holders[:4]))
    return t
