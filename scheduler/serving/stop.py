"""Stop strings, matched on the text as it streams out (on the sender thread).

Text that could be the start of a stop string is held back until the next piece
decides it, so a stop string split across two tokens is still found and never
reaches the client. The text before the match is the output; the match itself
is not sent (OpenAI's convention).
"""

from __future__ import annotations


class StopMatcher:
    __slots__ = ("_stops", "_hold", "_pending", "done")

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.done = False  # a stop string matched: nothing more is sent

    def push(self, text: str) -> str:
        """The text that can be sent now."""
        if self.done:
            return ""
        if not self._stops:
            return text
        buf = self._pending + text
        # the stop string that ends first (then the longest): the same answer however
        # the text was cut into pieces
        hits = [(i + len(s), i) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self.done = True
            self._pending = ""
            return buf[: min(hits)[1]]
        cut = max(len(buf) - self._hold, 0)
        # keep back only a tail that could still grow into a stop string
        while cut < len(buf) and not any(s.startswith(buf[cut:]) for s in self._stops):
            cut += 1
        self._pending = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        """At the end of the output: what was held back."""
        out, self._pending = ("" if self.done else self._pending), ""
        return out
