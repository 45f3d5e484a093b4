"""When the HTTP server read each request: the hop's first leg, before the route runs.

A route runs once its request is parsed and its ASGI task has had its turn on the event
loop; what came before (the loop getting to the bytes, the parse, the task's wait) cannot be
seen from a route or a middleware. uvicorn's httptools protocol, subclassed
(scheduler/serving/http_protocol.py), stamps the request's scope when the parser meets its
first bytes and when its body is complete; the route stamps its own start once the body is
validated (scheduler/serving/app.py). The responder writes the three as the `http_read`,
`http_body` and `http_route` timeline events of each engine request it submits (docs/trace-schema.md),
beside the engine's `arrived` (the submit), so a request's hop in is cut in legs from the
trace alone (`mstrace bench-serve --trace`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from probes.clock import now_ns

EXTENSION = "mstrace.http"  # the scope's `extensions` key (ASGI's place for a server's own)
STAGES = ("http_read", "http_body", "http_route")
# A stream's first token: the sender posted it to the event loop, its chunk was handed to
# the server to write (scheduler/serving/responses.py); `bench-serve --trace` cuts the hop
# out at them
OUT_STAGES = ("http_first_posted", "http_first_handed")


@dataclass(slots=True, frozen=True)
class HttpTimes:
    """One request's stamps, CLOCK_MONOTONIC ns like every trace time."""

    read_ns: int  # the parser met its first bytes
    body_ns: int  # its body was complete
    route_ns: int  # the route began, the body validated

    def events(self) -> tuple[tuple[int, str], ...]:
        return tuple(zip((self.read_ns, self.body_ns, self.route_ns), STAGES, strict=True))


def http_times(scope: Mapping[str, Any]) -> HttpTimes | None:
    """The request's stamps with the route's start now; None when another protocol served it."""
    stamps = scope.get("extensions", {}).get(EXTENSION)
    if stamps is None or "body_ns" not in stamps:
        return None
    return HttpTimes(stamps["read_ns"], stamps["body_ns"], now_ns())
