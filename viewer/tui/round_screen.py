"""The detail screens: one round, one request. Shared by `top` (from its live window)
and `view` (from the whole trace); from a round you reach its requests and back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from viewer.tui.render import COLOURS, colour


@dataclass(slots=True)
class RoundDetail:
    step: int
    row: dict[str, Any]  # the steps row ({} when the window no longer has it)
    probes: list[dict[str, Any]]  # ts_ns, dur_ns, boundary, stream, rank
    requests: list[str] = field(default_factory=list)
    blocks: list[dict[str, Any]] = field(default_factory=list)  # the memory rows of this round
    note: str = ""


@dataclass(slots=True)
class RequestDetail:
    request_id: str
    row: dict[str, Any]
    stages: list[tuple[str, int, int]]  # (stage, ts_ns, step)
    rounds: list[int]
    blocks: list[dict[str, Any]]


def live_round(state: Any, step: int) -> RoundDetail:
    """A round from `top`'s window: its row and probe rows (requests and blocks: `view`)."""
    row, rows = state.round_rows(step)
    return RoundDetail(step, row, rows, note="live window: `mstrace view TRACE` shows its requests and blocks")


def round_head(d: RoundDetail) -> Text:
    t = Text()
    t.append(f"round {d.step}\n", style="bold")
    r = d.row
    if r:
        t.append(f"{r['dur_ns'] / 1e6:.2f} ms (host {r['dur_host_ns'] / 1e6:.2f}, device {r['dur_device_ns'] / 1e6:.2f}); "
                 f"prefill {r['num_prefill_reqs']} reqs / {r['num_prefill_tokens']} tokens, decode "
                 f"{r['num_decode_reqs']}; blocks used {r['blocks_used']} free {r['blocks_free']}; "
                 f"waiting {r['num_waiting']} running {r['num_running']}")
    if d.note:
        t.append("\n" + d.note, style="dim")
    return t


def round_timeline(d: RoundDetail, width: int) -> Text:
    t = Text()
    if not d.probes:
        t.append("(no probe rows)", style="dim")
        return t
    t0 = min(x["ts_ns"] for x in d.probes)
    t1 = max(x["ts_ns"] + x["dur_ns"] for x in d.probes)
    span = max(1, t1 - t0)
    bar_w = max(10, width - 52)
    t.append(f"{'stream':<14}{'boundary':<20}{'at ms':>7}{'ms':>7}  timeline", style="bold")
    for x in sorted(d.probes, key=lambda x: (x["rank"], x["stream"], x["ts_ns"])):
        a = int((x["ts_ns"] - t0) / span * bar_w)
        w = max(1, int(x["dur_ns"] / span * bar_w))
        t.append(f"\nr{x['rank']} {x['stream']:<11}{x['boundary']:<20}{(x['ts_ns'] - t0) / 1e6:>7.2f}"
                 f"{x['dur_ns'] / 1e6:>7.2f}  ")
        t.append(" " * a)
        t.append(COLOURS.get(x["boundary"], ("", "?"))[1] * min(w, bar_w - a), style=f"black on {colour(x['boundary'])}")
    return t


def blocks_table(blocks: list[dict[str, Any]]) -> Table:
    tb = Table(box=None, header_style="bold", title="blocks", title_justify="left")
    for c in ("kind", "block", "request", "refs"):
        tb.add_column(c)
    for b in blocks[:200]:
        tb.add_row(str(b["kind"]), str(b["block_id"]), str(b["request_id"] or ""), str(b["ref_count"]))
    if len(blocks) > 200:
        tb.add_row("...", f"{len(blocks) - 200} more", "", "")
    return tb


class _Detail(Screen[None]):
    """A round's or a request's page; enter on its list opens the other kind, escape goes back.

    The head (what it is, its summary) never scrolls; below it the timeline or stages
    scroll in their own box, and the list and the blocks share the rest side by side, so
    at 80x24 the summary and the list's first rows are on screen together. `tab` moves
    between the boxes; arrows, PageUp/Down and Home/End scroll the focused one.
    """

    BINDINGS = [Binding("escape,q", "dismiss", "back")]
    DEFAULT_CSS = """
    _Detail .head { height: auto; max-height: 6; background: $boost; padding: 0 1; }
    _Detail .body { height: auto; max-height: 50%; }
    _Detail .body.alone { max-height: 100%; }
    _Detail .lists { height: 1fr; min-height: 5; }
    _Detail .lists DataTable { width: 30; height: 100%; }
    _Detail .lists VerticalScroll { width: 1fr; height: 100%; }
    """

    def __init__(self, open_round: Callable[[int], RoundDetail | None] | None,
                 open_request: Callable[[str], RequestDetail | None] | None) -> None:
        super().__init__()
        self._open_round = open_round
        self._open_request = open_request

    def _page(self, name: str, head: Text, body: Text, title: str, keys: list[str],
              blocks: list[dict[str, Any]]) -> ComposeResult:
        yield Static(head, id=f"{name}-head", classes="head")
        has_lists = bool(keys or blocks)
        yield VerticalScroll(Static(body), id=f"{name}-body", classes="body" if has_lists else "body alone")
        if has_lists:
            with Horizontal(classes="lists"):
                if keys:
                    t: DataTable[str] = DataTable(id=f"{name}-list", cursor_type="row")
                    t.add_column(title)
                    for k in keys:
                        t.add_row(k, key=k)
                    yield t
                if blocks:
                    yield VerticalScroll(Static(blocks_table(blocks)), id=f"{name}-blocks")
        yield Footer()

    def on_mount(self) -> None:
        lists = self.query(DataTable)
        (lists.first() if lists else self.query_one(VerticalScroll)).focus()


class RoundScreen(_Detail):
    def __init__(self, detail: RoundDetail, open_round: Callable[[int], RoundDetail | None] | None = None,
                 open_request: Callable[[str], RequestDetail | None] | None = None) -> None:
        super().__init__(open_round, open_request)
        self.detail = detail

    def compose(self) -> ComposeResult:
        d = self.detail
        yield from self._page("round", round_head(d), round_timeline(d, self.app.size.width), "requests in this round",
                              d.requests, d.blocks)

    def on_data_table_row_selected(self, ev: DataTable.RowSelected) -> None:
        ev.stop()
        got = self._open_request(str(ev.row_key.value)) if self._open_request is not None else None
        if got is not None:
            self.app.push_screen(RequestScreen(got, self._open_round, self._open_request))


def request_head(d: RequestDetail) -> Text:
    r = d.row
    t = Text()
    t.append(f"request {d.request_id}", style="bold")
    if r:
        ttft = (r["first_token_ns"] - r["arrival_ns"]) / 1e6 if r["first_token_ns"] > 0 else None
        e2e = (r["finish_ns"] - r["arrival_ns"]) / 1e6
        itl = max(r["dur_itl_ns"] or [0]) / 1e6
        t.append(f"\nprompt {r['prompt_len']} tokens (cached {r['cached_prefix_len']}), output {r['output_len']}, "
                 f"{r['finish_reason']}; TTFT {'-' if ttft is None else f'{ttft:.1f}'} ms, max ITL {itl:.1f} ms, "
                 f"E2E {e2e:.1f} ms, preempted {r['num_preemptions']}x")
    return t


def request_stages(d: RequestDetail) -> Text:
    t = Text()
    t.append(f"{'stage':<22}{'at ms':>10}{'lasted ms':>11}{'round':>8}", style="bold")
    base = d.stages[0][1] if d.stages else 0
    for i, (stage, ts, step) in enumerate(d.stages):
        nxt = d.stages[i + 1][1] if i + 1 < len(d.stages) else None
        lasted = "" if nxt is None else f"{(nxt - ts) / 1e6:.2f}"
        t.append(f"\n{stage:<22}{(ts - base) / 1e6:>10.2f}{lasted:>11}{step if step >= 0 else '':>8}")
    return t


class RequestScreen(_Detail):
    def __init__(self, detail: RequestDetail, open_round: Callable[[int], RoundDetail | None] | None = None,
                 open_request: Callable[[str], RequestDetail | None] | None = None) -> None:
        super().__init__(open_round, open_request)
        self.detail = detail

    def compose(self) -> ComposeResult:
        d = self.detail
        yield from self._page("request", request_head(d), request_stages(d), f"its {len(d.rounds)} rounds",
                              [str(x) for x in d.rounds], d.blocks)

    def on_data_table_row_selected(self, ev: DataTable.RowSelected) -> None:
        ev.stop()
        got = self._open_round(int(str(ev.row_key.value))) if self._open_round is not None else None
        if got is not None:
            self.app.push_screen(RoundScreen(got, self._open_round, self._open_request))
