"""An incremental Server-Sent Events parser: bytes in as they arrive, events out.

It follows the event-stream interpretation of WHATWG HTML (section "Server-sent
events"), not one server's habits: lines end with CRLF, LF or CR; `data:` takes its
value with or without one leading space; a line starting with `:` is a comment (a
keep-alive ping); the `data` lines of one event are joined with LF; a blank line
dispatches the event; an event with no `data` line dispatches nothing; `event:`
names the event's type and `id:` sets the last event id, which later events keep.
sse-starlette, which many OpenAI-compatible servers stream through, ends its lines
with CRLF; mstrace's own server with LF.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_EOL = re.compile(rb"\r\n?|\n")
_BOM = b"\xef\xbb\xbf"


@dataclass(slots=True, frozen=True)
class Event:
    data: str
    event: str = "message"
    id: str = ""


class SSEParser:
    """Feed it the body's bytes in any pieces; each call returns the events those
    bytes completed. Lines are split on bytes, which is safe in UTF-8 (CR and LF never
    occur inside a multi-byte character), and decoded whole."""

    __slots__ = ("_buf", "_skip_lf", "_started", "_data", "_event", "_id")

    def __init__(self) -> None:
        self._buf = b""
        self._skip_lf = False  # the last piece ended with CR: an LF next is the same line end
        self._started = False  # the stream's leading BOM, if any, is behind us
        self._data: list[str] = []
        self._event = ""
        self._id = ""

    def feed(self, piece: bytes) -> list[Event]:
        if self._skip_lf and piece:
            self._skip_lf = False
            if piece[:1] == b"\n":
                piece = piece[1:]
        buf = self._buf + piece
        if not self._started:
            if len(buf) < len(_BOM) and _BOM.startswith(buf):
                self._buf = buf
                return []
            self._started = True
            buf = buf.removeprefix(_BOM)
        out: list[Event] = []
        start = 0
        for m in _EOL.finditer(buf):
            # a CR at the very end dispatches now, rather than when the next piece comes
            if m.end() == len(buf) and m.group() == b"\r":
                self._skip_lf = True
            self._line(buf[start:m.start()].decode("utf-8", "replace"), out)
            start = m.end()
        self._buf = buf[start:]
        return out

    def close(self) -> list[Event]:
        """The end of the stream. An event not yet ended by a blank line is dropped, as
        the spec says (a stream cut mid-event must not yield half of it)."""
        self._buf, self._data, self._event = b"", [], ""
        return []

    def _line(self, line: str, out: list[Event]) -> None:
        if not line:
            if self._data:
                out.append(Event("\n".join(self._data), self._event or "message", self._id))
            self._data, self._event = [], ""
            return
        if line[0] == ":":
            return
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        # "retry" (a reconnection delay) and unknown fields: nothing for a benchmark to do
