"""`view`'s sort picker: `s` lists a table's columns, each with a key of its own, so any
column (a boundary's cost among a dozen) is two keys away: `s`, then its key. `enter`
takes the highlighted one; picking the column already sorted on reverses the order.
"""

from __future__ import annotations

import string

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.events import Key
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

# digits first, then letters; `s` and `q` are left out so a doubled or stray key never
# picks a column the user did not mean
HOTKEYS = [c for c in "1234567890" + string.ascii_lowercase if c not in "sq"]


class SortPicker(ModalScreen[int | None]):
    DEFAULT_CSS = """
    SortPicker { align: center middle; }
    SortPicker > Vertical { width: auto; min-width: 36; max-width: 90%; height: auto; max-height: 90%;
                            border: round $accent; background: $surface; padding: 0 1; }
    SortPicker OptionList { height: auto; max-height: 100%; border: none; }
    """
    BINDINGS = [Binding("escape", "dismiss(None)", "cancel")]

    def __init__(self, columns: list[str], current: int, reverse: bool) -> None:
        super().__init__()
        self.columns, self.current, self.reverse = columns, current, reverse

    def compose(self) -> ComposeResult:
        opts = []
        for i, c in enumerate(self.columns):
            label = Text()
            label.append(f"{HOTKEYS[i] if i < len(HOTKEYS) else ' '}  ", style="bold")
            label.append(c)
            if i == self.current:
                label.append("  (sorted " + ("largest first)" if self.reverse else "smallest first)"), style="dim")
            opts.append(Option(label, id=str(i)))
        with Vertical():
            yield Static(Text("sort by: a column's key, or enter (again: the other way)", style="bold"))
            yield OptionList(*opts, id="sort-columns")

    def on_mount(self) -> None:
        ol = self.query_one(OptionList)
        ol.highlighted = self.current
        ol.focus()

    def on_key(self, ev: Key) -> None:
        if ev.character and ev.character in HOTKEYS:
            i = HOTKEYS.index(ev.character)
            if i < len(self.columns):
                ev.stop()
                self.dismiss(i)

    def on_option_list_option_selected(self, ev: OptionList.OptionSelected) -> None:
        ev.stop()
        self.dismiss(int(ev.option.id or 0))
