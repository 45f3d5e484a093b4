"""`mstrace view TRACE`: a browser for a finished or truncated trace.

Tabs: rounds (sortable by duration or any boundary's cost, `s` then a column's key; a filter), requests
(sortable by TTFT, max ITL, E2E), stalls, leaks. Enter opens a round or a request;
from a round you reach its requests, from a request its rounds, and escape goes back.
A table shows at most `SHOWN` rows of the sorted, filtered list, so a run of a
million rounds stays quick to browse.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Footer, Input, Static, TabbedContent, TabPane

from viewer.tui.round_screen import RequestScreen, RoundScreen
from viewer.tui.sort_picker import SortPicker
from viewer.tui.view_data import REQUEST_COLS, TraceBrowser

if TYPE_CHECKING:
    from viewer.export.window import Window

SHOWN = 2000
_FILTER = re.compile(r"^\s*(.+?)\s*(>=|<=|>|<|=)\s*(-?[\d.]+)\s*$")


class Listing:
    """Rows of one tab: the sort column and order, the filter, and what is shown."""

    def __init__(self, columns: list[str], rows: list[tuple[Any, ...]], sort: int, reverse: bool = True) -> None:
        self.columns, self.all, self.sort, self.reverse = columns, rows, sort, reverse
        self.filter = ""
        self.error = ""

    def column(self, name: str) -> int | None:
        name = name.strip().lower()
        exact = [i for i, c in enumerate(self.columns) if c.lower() == name]
        pref = [i for i, c in enumerate(self.columns) if c.lower().startswith(name)]
        found = exact or pref
        return found[0] if found else None

    def rows(self) -> list[tuple[Any, ...]]:
        rows = self.all
        self.error = ""
        if self.filter.strip():
            m = _FILTER.match(self.filter)
            col = self.column(m.group(1)) if m else None
            if m is None or col is None:
                self.error = f"filter: COLUMN OP NUMBER, e.g. `ms>50` or `kv_fence ms>0.1` (columns: {', '.join(self.columns)})"
            else:
                op, x = m.group(2), float(m.group(3))
                tests: dict[str, Callable[[float], bool]] = {
                    ">": lambda v: v > x, "<": lambda v: v < x, ">=": lambda v: v >= x, "<=": lambda v: v <= x,
                    "=": lambda v: v == x}
                test = tests[op]
                rows = [r for r in rows if isinstance(r[col], int | float) and test(r[col])]
        k = self.sort

        def key(r: tuple[Any, ...]) -> tuple[int, Any]:
            v = r[k]
            return (0, v) if v is not None else (-1, 0) if self.reverse else (1, 0)

        return sorted(rows, key=key, reverse=self.reverse)


class ViewApp(App[None]):
    TITLE = "mstrace view"
    CSS = """
    #status { height: auto; background: $boost; }
    DataTable { height: 1fr; }
    #rounds-filter { dock: top; }
    .note { height: auto; color: $text-muted; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        # Ctrl-C quits, as in any terminal program (Textual only says "press ctrl+q"); from
        # any screen, the round pages and the sort picker included
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("s", "sort", "sort"),
        Binding("slash", "filter", "filter", key_display="/"),
        Binding("1", "tab('rounds')", "rounds"),
        Binding("2", "tab('requests')", "requests"),
        Binding("3", "tab('stalls')", "stalls"),
        Binding("4", "tab('leaks')", "leaks"),
    ]

    def __init__(self, trace: str | Path, window: Window | None = None) -> None:
        super().__init__()
        self.browser = TraceBrowser(trace, window)
        r = self.browser.rounds()
        self.listings = {
            "rounds": Listing(r.columns, r.rows, sort=1),  # slowest rounds first
            "requests": Listing(list(REQUEST_COLS), self.browser.request_rows(), sort=5),  # slowest E2E first
        }

    def compose(self) -> ComposeResult:
        st = self.browser.trace.status
        head = st.headline() or "complete"
        # Text, not markup: a path or the status in brackets is shown as it is
        w = self.browser.window
        yield Static(Text(f"{self.browser.root}  {self.browser.meta.get('model', {}).get('name', '?')}  "
                          f"{len(self.listings['rounds'].all):,} rounds  {len(self.listings['requests'].all):,} requests  "
                          f"[{head}]" + (f"  window: {w.what} (the rounds and requests it overlaps)" if w else "")),
                     id="status")
        with TabbedContent(initial="rounds", id="tabs"):
            with TabPane("rounds", id="rounds"):
                yield Input(placeholder="filter, e.g. ms>50 (enter applies, empty clears)", id="rounds-filter")
                yield Static("", id="rounds-note", classes="note")
                yield DataTable(id="rounds-table", cursor_type="row", zebra_stripes=True, fixed_columns=1)
            with TabPane("requests", id="requests"):
                yield Input(placeholder="filter, e.g. TTFT>100", id="requests-filter")
                yield Static("", id="requests-note", classes="note")
                yield DataTable(id="requests-table", cursor_type="row", zebra_stripes=True, fixed_columns=1)
            with TabPane("stalls", id="stalls"):
                yield VerticalScroll(Static(self.browser.stalls_text(max(60, self.size.width - 4)), id="stalls-text"),
                                     id="stalls-scroll")
            with TabPane("leaks", id="leaks"):
                yield VerticalScroll(Static(self.browser.leaks_text(max(60, self.size.width - 4)), id="leaks-text"),
                                     id="leaks-scroll")
        yield Footer()

    def on_mount(self) -> None:
        for name in self.listings:
            self.fill(name)
        self.query_one("#rounds-table", DataTable).focus()

    def fill(self, name: str) -> None:
        li = self.listings[name]
        t = self.query_one(f"#{name}-table", DataTable)
        t.clear(columns=True)
        for i, c in enumerate(li.columns):
            t.add_column(c + (" ▼" if li.reverse else " ▲") * (i == li.sort), key=str(i))
        rows = li.rows()
        for r in rows[:SHOWN]:
            t.add_row(*("-" if v is None else v for v in r), key=str(r[0]))
        self.call_after_refresh(self._show_column, t, li.sort)
        shown = f"showing {min(SHOWN, len(rows)):,} of {len(rows):,}" + (" (sort or filter for the rest)"
                                                                       if len(rows) > SHOWN else "")
        self.query_one(f"#{name}-note", Static).update(li.error or f"{shown}; s sorts (then a column's key), "
                                                                    f"/ filters, enter opens")

    @staticmethod
    def _show_column(t: DataTable[Any], k: int) -> None:
        """Scroll the sorted column into view beside the fixed first one: at 80 columns a
        boundary's column is off to the right, and a sort one cannot see is no sort."""
        widths = [c.get_render_width(t) for c in t.ordered_columns]
        x, room = sum(widths[:k]), t.scrollable_content_region.width
        # Clamped here, from the columns just added: the table's own limit may still be the one
        # of the columns before the re-fill when this runs (a wider header: a scroll too far).
        t.scroll_to(x=0 if x + widths[k] <= room else min(x - widths[0], max(0, sum(widths) - room)), animate=False)

    def _current(self) -> str | None:
        tab = self.query_one("#tabs", TabbedContent).active
        return tab if tab in self.listings else None

    # ---- keys and events ------------------------------------------------------------
    def action_tab(self, name: str) -> None:
        self.query_one("#tabs", TabbedContent).active = name
        # focus into the new tab: focus left behind in the hidden one would switch it back
        target = f"#{name}-table" if name in self.listings else f"#{name}-scroll"
        self.query_one(target).focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # the list's keys belong to the list: on a round's page they would act unseen behind it
        if action in ("sort", "filter", "tab") and self.screen is not self.screen_stack[0]:
            return False
        return True

    def action_sort(self) -> None:
        name = self._current()
        if name is None:
            return
        li = self.listings[name]

        def picked(col: int | None) -> None:
            if col is not None:
                self._sort_by(name, col)
            self.query_one(f"#{name}-table", DataTable).focus()

        self.push_screen(SortPicker(li.columns, li.sort, li.reverse), picked)

    def _sort_by(self, name: str, col: int) -> None:
        li = self.listings[name]
        li.reverse = not li.reverse if li.sort == col else True
        li.sort = col
        self.fill(name)

    def on_data_table_header_selected(self, ev: DataTable.HeaderSelected) -> None:
        name = (ev.data_table.id or "").removesuffix("-table")
        if name in self.listings:
            self._sort_by(name, ev.column_index)

    def action_filter(self) -> None:
        name = self._current()
        if name is not None:
            self.query_one(f"#{name}-filter", Input).focus()

    def on_input_submitted(self, ev: Input.Submitted) -> None:
        name = (ev.input.id or "").removesuffix("-filter")
        if name in self.listings:
            self.listings[name].filter = ev.value
            self.fill(name)
            self.query_one(f"#{name}-table", DataTable).focus()

    def on_data_table_row_selected(self, ev: DataTable.RowSelected) -> None:
        key = str(ev.row_key.value)
        if ev.data_table.id == "rounds-table":
            self.open_round(int(key))
        elif ev.data_table.id == "requests-table":
            self.open_request(key)

    def open_round(self, step: int) -> None:
        d = self.browser.round_detail(step)
        if d is not None:
            self.push_screen(RoundScreen(d, self.browser.round_detail, self.browser.request_detail), self._back)

    def open_request(self, rid: str) -> None:
        d = self.browser.request_detail(rid)
        if d is not None:
            self.push_screen(RequestScreen(d, self.browser.round_detail, self.browser.request_detail), self._back)

    def _back(self, _: object = None) -> None:
        name = self._current()
        if name is not None:  # back on the list, not in its filter box
            self.query_one(f"#{name}-table", DataTable).focus()
