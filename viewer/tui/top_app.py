"""`mstrace top TRACE`: a live view of a run or a server, from its committed flushes.

The app never talks to the engine: it tails the trace directory (viewer/live/tail.py),
so it works the same on a folder shared from another machine, and the engine pays
only for the flushes it writes anyway. A feed thread reads the new parts, folds them
into `LiveState`'s windows and takes a snapshot, 4 times a second; the event loop only
paints what it hands over, so reading Parquet never holds up a key or a repaint. Per
refresh the app keeps: `fold_ms` (the feed thread's read, fold and snapshot),
`tick_ms` / `tick_cpu_ms` (the event loop's wall and CPU time from taking the snapshot
to the screen showing it) and `age_ms` (from the read's start to the screen). The
benchmark reads them.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import RenderableType
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import Footer, Static
from textual.worker import get_current_worker

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
    /* maximized, a panel fills the screen: its own width (3fr of a row it has left) would
       run off the right edge, and an auto height would leave it a strip */
    Panel.-maximized { width: 100% !important; height: 100% !important; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        # Ctrl-C quits, as in any terminal program (Textual only says "press ctrl+q"); from
        # any screen, the round pages and the sort picker included
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
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
        self.state = LiveState(lane_s=lane_s, rounds=rounds, keep_s=ZOOM[-1])
        self.view: TopView | None = None
        self.paused = False
        self.cursor: float | None = None  # 0..1 across the lanes' window
        self.tick_ms: list[float] = []
        self.tick_cpu_ms: list[float] = []
        self.fold_ms: list[float] = []
        self.age_ms: list[float] = []
        # the feed thread folds into `state`; the event loop takes it for a key's own snapshot
        self._lock = threading.Lock()
        self.error: str | None = None
        self._process_state = process_state  # `run --live`: how its run process is doing
        self._drawn: tuple[object, ...] | None = None
        self._said: str | None = "-"  # the banner's text (None: no banner)
        self._shape: int | None = None

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
        self._show(*self._fold())  # the first picture synchronously: a first frame is never blank
        # What is alive now (Textual's widgets, the attached windows) lives as long as the app:
        # frozen, a full collection no longer walks it (42 ms, once in 20 s, before).
        gc.freeze()
        self.run_worker(self._feed, thread=True, exclusive=True, group="feed")

    def on_unmount(self) -> None:
        gc.unfreeze()

    # ---- the refresh -----------------------------------------------------------
    def _fold(self) -> tuple[TopView | None, str | None, float]:
        """Read what was committed since the last call, fold it in, take a snapshot."""
        t0 = time.perf_counter()
        with self._lock:
            try:
                poll = self.tail.poll()
            except TraceError as e:
                return self.view, str(e), t0
            if poll is None:
                return self.view, None, t0
            self.state.update(poll)
            view = self.state.snapshot()
        self.fold_ms.append((time.perf_counter() - t0) * 1e3)
        return view, None, t0

    def _feed(self) -> None:
        """The feed thread: a fold every REFRESH_S, handed to the event loop to paint.
        It waits for each paint to be queued, so folding and painting never overlap."""
        worker = get_current_worker()
        due = time.monotonic()
        while not worker.is_cancelled:
            due += REFRESH_S
            time.sleep(max(0.0, due - time.monotonic()))
            due = max(due, time.monotonic() - REFRESH_S)  # after a stall: no burst to catch up
            if self.paused or worker.is_cancelled:
                continue
            got = self._fold()
            try:
                self.call_from_thread(self._show, *got)
            except RuntimeError:  # the app is closing
                return

    def _show(self, view: TopView | None, error: str | None, t_read: float) -> None:
        if self.paused:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        self.view, self.error = view, error
        self.redraw()

        def done() -> None:  # at the screen's next refresh: the redraw's rendering counts too
            t = time.perf_counter()
            self.tick_ms.append((t - t0) * 1e3)
            self.tick_cpu_ms.append((time.thread_time() - c0) * 1e3)
            self.age_ms.append((t - t_read) * 1e3)

        self.call_after_refresh(done)

    def redraw(self) -> None:
        v = self.view
        if v is None:
            head: RenderableType = f"mstrace top {self.trace}"
            b: Text | None = render.banner_waiting(self.error or f"waiting for {self.trace} (no trace there yet)")
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
        shape = render.lanes_rows(v, max(20, self.query_one("#lanes", Panel).content_size.width))
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
        with self._lock:
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
        with self._lock:
            detail = live_round(self.state, step)
        self.push_screen(RoundScreen(detail))

    def action_maximize_panel(self) -> None:
        if self.screen.maximized is not None:
            self.screen.minimize()
        elif isinstance(self.focused, Panel):
            self.screen.maximize(self.focused)

    def _refresh_now(self) -> None:
        if self.view is not None:
            with self._lock:
                self.view = self.state.snapshot()
        self.redraw()
