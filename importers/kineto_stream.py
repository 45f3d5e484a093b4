"""One torch.profiler (Kineto) trace file read as a stream of events, in bounded memory.

A Kineto trace is one JSON object: a few top-level keys (`schemaVersion`,
`deviceProperties`, `distributedInfo`, `baseTimeNanoseconds`, ...) around `traceEvents`, an
array that is nearly all of the file (2-10 GB on a long GPU run). The array is parsed item
by item with ijson's C backend (yajl): one event dict at a time, never the whole array
(BENCHMARKS.md "Importing a Kineto trace" measures it). The few top-level keys are read
from the bytes before the array and after it, which the reader keeps as they pass.

A file cut off mid-write (a profiler killed while dumping, a copy that ran out of disk)
yields every complete event before the cut and then says where it stopped (`truncated`).
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HEAD_BYTES = 1 << 20  # the top-level keys Kineto writes before traceEvents fit well within this
TAIL_BYTES = 1 << 18
# top-level keys read from the head or the tail of the file
META_KEYS = ("schemaVersion", "deviceProperties", "distributedInfo", "baseTimeNanoseconds", "traceName",
             "displayTimeUnit", "roctracer_version", "cupti_version", "cuda_runtime_version", "hip_runtime_version")


class KinetoError(ValueError):
    """The file is not a Kineto trace (or not readable at all): one line for the user."""


class _Window:
    """A binary reader that remembers the first HEAD_BYTES and the last TAIL_BYTES it passed."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.head = bytearray()
        self.tail = bytearray()
        self.read_bytes = 0

    def read(self, n: int = -1) -> bytes:
        b = self.raw.read(n)
        self.read_bytes += len(b)
        if len(self.head) < HEAD_BYTES:
            self.head += b[:HEAD_BYTES - len(self.head)]
        self.tail += b
        if len(self.tail) > 2 * TAIL_BYTES:
            del self.tail[:len(self.tail) - TAIL_BYTES]
        return b


@dataclass(slots=True)
class KinetoFile:
    """`events()` streams the events once; `meta` and `truncated` are complete after it."""

    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    truncated: str | None = None  # why the events stopped early (None: the file is whole)
    events_read: int = 0

    def events(self) -> Iterator[dict[str, Any]]:
        import ijson

        win = _Window(_open(self.path))
        try:
            it = ijson.items(win, "traceEvents.item", use_float=True)
            try:
                for ev in it:
                    if isinstance(ev, dict):
                        self.events_read += 1
                        yield ev
            except (ijson.IncompleteJSONError, ijson.JSONError, EOFError, zlib.error, gzip.BadGzipFile,
                    UnicodeDecodeError) as e:
                if not self.events_read:
                    raise KinetoError(f"{self.path}: not a Kineto trace: not JSON ({_first_line(e)})") from None
                self.truncated = (f"cut off after {self.events_read} complete events "
                                  f"({win.read_bytes} bytes read: {_first_line(e)})")
        finally:
            win.raw.close()
        self.meta = _top_level(bytes(win.head), bytes(win.tail))
        if not self.events_read and b'"traceEvents"' not in win.head:
            raise KinetoError(f"{self.path}: not a Kineto trace: no traceEvents array")


def _open(path: Path) -> IO[bytes]:
    try:
        f = path.open("rb")
    except OSError as e:
        raise KinetoError(f"cannot read {path}: {e.strerror or e}") from None
    magic = f.read(2)
    f.seek(0)
    return gzip.GzipFile(fileobj=f) if magic == b"\x1f\x8b" else f  # type: ignore[return-value]


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def _top_level(head: bytes, tail: bytes) -> dict[str, Any]:
    """The META_KEYS found in the bytes before traceEvents or after its last event."""
    out: dict[str, Any] = {}
    at = head.find(b'"traceEvents"')
    before = head[:at] if at >= 0 else b""
    for text in (before.decode("utf-8", "replace"), tail.decode("utf-8", "replace")):
        for key in META_KEYS:
            if key in out:
                continue
            m = re.search(rf'"{key}"\s*:\s*', text)
            if m is None:
                continue
            try:
                out[key], _ = json.JSONDecoder().raw_decode(text, m.end())
            except ValueError:
                continue
    return out
