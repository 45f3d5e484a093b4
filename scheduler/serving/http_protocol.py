"""uvicorn's httptools protocol, its requests stamped as scheduler/serving/http_timing.py says
(imports uvicorn: only `serve` loads it)."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from probes.clock import now_ns
from scheduler.serving.http_timing import EXTENSION


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (`uvicorn.Config(http=...)`), its requests stamped."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope.setdefault("extensions", {})[EXTENSION] = {"read_ns": now_ns()}

    def on_message_complete(self) -> None:
        super().on_message_complete()
        stamps = self.scope.get("extensions", {}).get(EXTENSION)
        if stamps is not None:
            stamps["body_ns"] = now_ns()
