"""`mstrace top TRACE`: a live view of a run or a server, from its committed flushes.

The app never talks to the engine: it tails the trace directory (viewer/live/tail.py),
so it works the same on a folder shared from another machine, and the engine pays
only for the flushes it writes anyway. Each tick reads the new parts, folds them into
the windows of `LiveState` and redraws. Each tick's time until the screen shows it, and
the CPU time it took, are kept in `tick_ms` and `tick_cpu_ms` (the benchmark reads them).
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


class Line(Widget):
    """A fixed-height line of text: repainted without laying the screen out again."""

    def __init__(self, id: str) -> None:  # noqa: A002
        super().__init__(id=id)
        self._content: RenderableType = ""

    def show(self, content: RenderableType) -> None:
        self._content = content
        self.refresh()

    def render(self) -> RenderableType:
        return self._content


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
                 process_state: Callable[[], str | None] | None = None) -> None:
        super().__init__()
        self.trace = Path(trace)
        self.tail = TraceTail(self.trace)
        self.state = LiveState(lane_s=lane_s, rounds=rounds)
        self.view: TopView | None = None
        self.paused = False
        self.cursor: float | None = None  # 0..1 across the lanes' window
        # per refresh: wall time until the screen showed it, and this thread's CPU time meanwhile
        # (everything the event loop did, waiting excluded)
        self.tick_ms: list[float] = []
        self.tick_cpu_ms: list[float] = []
        self.error: str | None = None
        self._process_state = process_state  # `run --live`: how its run process is doing
        self._drawn: tuple[object, ...] | None = None
        self._said: str | None = "-"  # the banner's text (None: no banner)
        self._shape: tuple[int, int] | None = None

    def compose(self) -> ComposeResult:
        yield Line(id="head")
        yield Static(id="banner")
        yield Panel(lambda w: render.lanes(self.view, w, self.cursor) if self.view else "", id="lanes")
        with Horizontal(id="lower"):
            yield Panel(lambda w: render.cost(self.view, w) if self.view else "", id="cost")
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
        t0, c0 = time.perf_counter(), time.thread_time()
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

        def done() -> None:  # at the screen's next refresh: the redraw's rendering counts too
            self.tick_ms.append((time.perf_counter() - t0) * 1e3)
            self.tick_cpu_ms.append((time.thread_time() - c0) * 1e3)

        self.call_after_refresh(done)

    def redraw(self) -> None:
        v = self.view
        if v is None:
            head: RenderableType = f"mstrace top {self.trace}"
            b = render.banner_waiting(self.error or f"waiting for {self.trace} (no trace there yet)")
        else:
            head = render.header(v, self.paused)
            note = self.error or (self._process_state() if self._process_state is not None else None)
            b = render.banner(v, note)
        said = b.plain if b is not None else None
        drawn = (id(v), self.cursor, self.paused, said)
        if drawn == self._drawn:
            return  # nothing new: a redraw would repaint the same
        self._drawn = drawn
        self.query_one("#head", Line).show(head)
        banner = self.query_one("#banner", Static)
        if said != self._said:  # a Static's update lays the screen out again: only on a change
            self._said = said
            banner.set_class(b is not None, "shown")
            banner.update(b or "")
        if v is None:
            return
        shape = (len(v.lanes), len({x for ln in v.lanes for x in ln.boundary}))
        for panel in self.query(Panel):
            # a new layout only when the lanes' height changes: a reflow costs more than the paint
            panel.refresh(layout=panel.id == "lanes" and shape != self._shape)
        self._shape = shape

    # ---- keys --------------------------------------------------------------------
    def action_pause(self) -> None:
        self.paused = not self.paused
        self.redraw()

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
