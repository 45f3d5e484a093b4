"""The flags that choose a window of a trace (`report --html`, `export --perfetto`, `view`,
`whatif`): one declaration each and one parse (viewer/export/window.py), so every command
takes the same flags with the same meaning."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

Rounds = Annotated[str | None, typer.Option("--rounds", metavar="A-B", help="Window: rounds A to B (and whatever "
                                           "overlaps them in time).")]
TimeWindow = Annotated[str | None, typer.Option("--time", metavar="START-END", help="Window: this stretch, in "
                                                "seconds from the run's start.")]
Request = Annotated[str | None, typer.Option("--request", metavar="ID", help="Window: this request's life, with "
                                             "everything else that ran meanwhile.")]
Worst = Annotated[int | None, typer.Option("--worst", metavar="N", help="Window: the N slowest rounds, each with "
                                           "a round on either side.")]


def window_of(trace: Path, rounds: str | None, time_window: str | None, request: str | None,
              worst: int | None) -> Any:
    """The window the flags name (a viewer.export.window.Window), None for none; TraceError for
    a window the trace does not have."""
    if all(v is None for v in (rounds, time_window, request, worst)):
        return None
    from tracing.reader import Trace
    from viewer.export.window import parse_window

    return parse_window(Trace.open(trace), rounds, time_window, request, worst)
