"""What every text front end shares: the number formats, a trace's heading and its status line."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from tracing.run_status import RunStatus


def pct(x: float | None, missing: str = "—") -> str:
    """A share as a percentage with one decimal: 0.253 -> "25.3%"."""
    return missing if x is None else f"{100 * x:.1f}%"


def ms(x: float | None, places: int | None = 2, missing: str = "—") -> str:
    """Milliseconds with `places` decimals; places None: three significant digits at most
    (the live panels, where a column is narrow)."""
    if x is None:
        return missing
    if places is None:
        return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"
    return f"{x:.{places}f}"


def status_line(console: Console, status: RunStatus, trace: str) -> None:
    """The first line of every command on a trace that is not complete."""
    line = status.headline()
    if line is None:
        return
    if status.state == "stalled":
        line += f"; see `mstrace stalls {trace}`"
    console.print(f"[bold yellow]{escape(line)}[/]", highlight=False, soft_wrap=True)


def trace_heading(console: Console, trace: str, tail: str, lead: str = "") -> None:
    """A trace's path and what follows it as one line that the terminal wraps, not rich: rich
    would break a long path at the width (or the words after it), and a broken path no longer
    pastes into a shell."""
    console.print(Text.assemble((lead, "bold"), (str(trace), "bold"), tail), highlight=False, soft_wrap=True)
