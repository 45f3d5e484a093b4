"""`mstrace top TRACE`: a live view of a run or a server, from its committed flushes.

The app never talks to the engine: it tails the trace directory (viewer/live/tail.py),
so it works the same on a folder shared from another machine, and the engine pays
only for the flushes it writes anyway. Each tick reads the new parts, folds them into
the windows of `LiveState` and redraws; a tick's own time is kept in `tick_ms`, which
the benchmark reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from rich.console import RenderableType
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import Footer, Static

from tracing.reader import TraceError
from viewer.live.state import LiveState, TopView
from viewer.live.tail import TraceTail
from viewer.tui import render
from viewer.tui.round_screen import RoundScreen, live_round

REFRESH_S = 0.25  # 4 refreshes a second
ZOOM = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # lane windows, seconds


class Panel(Widget, can_focus=True):
    """A focusable box drawn at its own width when Textual lays it out (so a first frame
    never has a guessed width): tab moves between panels, m maximizes the focused one."""

    def __init__(self, draw: Callable[[int], RenderableType], id: str) -> None:  # noqa: A002
        super().__init__(id=id)
        self._draw = draw

    def render(self) -> RenderableType:
        return self._draw(max(20, self.content_size.width))


class TopApp(App[None]):
    TITLE = "mstrace top"
    CSS = """
    Screen { layout: vertical; }
    #head { height: 2; background: $boost; }
    #banner { height: auto; display: none; }
    #banner.shown { display: block; }
    Panel { width: 1fr; border: round $primary-darken-2; }
    #lanes { height: auto; min-height: 4; }
    #lower { height: 1fr; }
    #cost { width: 3fr; height: 1fr; overflow-y: auto; }
    #side { width: 2fr; }
    #latency { height: auto; }
    #kv { height: 1fr; }
    Panel:focus { border: round $accent; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("p", "pause", "pause"),
        Binding("tab", "focus_next", "panel", show=True),
        Binding("m", "maximize_panel", "max"),
        Binding("plus,equals_sign", "zoom(-1)", "zoom in", key_display="+"),
        Binding("minus", "zoom(1)", "zoom out", key_display="-"),
        Binding("left", "cursor(-1)", "cursor", show=False),
        Binding("right", "cursor(1)", "cursor", show=False),
        Binding("enter", "open_round", "round"),
    ]

    def __init__(self, trace: str | Path, lane_s: float = 2.0, rounds: int = 64,
                 process_state: Callable[[], str | None] | None = None, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        super().__init__()
        self.trace = Path(trace)
        self.tail = TraceTail(self.trace)
        self.state = LiveState(lane_s=lane_s, rounds=rounds)
        self.view: TopView | None = None
        self.paused = False
        self.cursor: float | None = None  # 0..1 across the lanes' window
        self.tick_ms: list[float] = []
        self.error: str | None = None
        self._process_state = process_state  # `run --live`: how its run process is doing
        self._clock = clock

    def compose(self) -> ComposeResult:
        yield Static(id="head")
        yield Static(id="banner")
        yield Panel(lambda w: render.lanes(self.view, w, self.cursor) if self.view else "", id="lanes")
        with Horizontal(id="lower"):
            yield Panel(lambda w: render.cost(self.view) if self.view else "", id="cost")
            with Vertical(id="side"):
                yield Panel(lambda w: render.latency(self.view, w) if self.view else "", id="latency")
                yield Panel(lambda w: render.kv(self.view, w) if self.view else "", id="kv")
        yield Footer()

    def on_mount(self) -> None:
        self.tick()
        self.set_interval(REFRESH_S, self.tick)

    # ---- the refresh -----------------------------------------------------------
    def tick(self) -> None:
        if self.paused:
            return
        t0 = self._clock()
        try:
            poll = self.tail.poll()
        except TraceError as e:
            self.error = str(e)
            poll = None
        if poll is not None:
            self.error = None
            self.state.update(poll)
            self.view = self.state.snapshot()
        self.redraw()
        self.tick_ms.append((self._clock() - t0) * 1e3)

    def redraw(self) -> None:
        v = self.view
        banner = self.query_one("#banner", Static)
        if v is None:
            why = self.error or f"waiting for {self.trace} (no trace there yet)"
            self.query_one("#head", Static).update(f"mstrace top {self.trace}")
            banner.update(render.banner_waiting(why))
            banner.add_class("shown")
            return
        self.query_one("#head", Static).update(render.header(v, self.paused))
        proc = self._process_state() if self._process_state is not None else None
        b = render.banner(v, proc)
        banner.set_class(b is not None, "shown")
        banner.update(b or "")
        for panel in self.query(Panel):
            panel.refresh(layout=panel.id == "lanes")  # the lanes' height follows their count

    # ---- keys --------------------------------------------------------------------
    def action_pause(self) -> None:
        self.paused = not self.paused
        if self.view is not None:
            self.query_one("#head", Static).update(render.header(self.view, self.paused))

    def action_zoom(self, way: int) -> None:
        now = self.state.lane_s
        i = min(range(len(ZOOM)), key=lambda k: abs(ZOOM[k] - now))
        self.state.lane_s = ZOOM[min(len(ZOOM) - 1, max(0, i + way))]
        self._refresh_now()

    def action_cursor(self, way: int) -> None:
        at = 1.0 if self.cursor is None else self.cursor
        self.cursor = min(0.999, max(0.0, at + way / 40))
        if not self.paused:  # a cursor on a moving strip: hold the picture while it is used
            self.paused = True
        self._refresh_now()

    def action_open_round(self) -> None:
        if self.view is None:
            return
        step = render.lane_round(self.view, self.cursor if self.cursor is not None else 1.0)
        if step is None:
            self.notify("no round under the cursor (left/right moves it)")
            return
        self.push_screen(RoundScreen(live_round(self.state, step)))

    def action_maximize_panel(self) -> None:
        if self.screen.maximized is not None:
            self.screen.minimize()
        elif isinstance(self.focused, Panel):
            self.screen.maximize(self.focused)

    def _refresh_now(self) -> None:
        if self.view is not None:
            self.view = self.state.snapshot()
        self.redraw()
