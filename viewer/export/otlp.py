"""`mstrace export TRACE --otlp URL`: replay a trace's request spans to an OTLP collector.

The spans are the rows of `TRACE/spans/` (tracing/otel.py wrote them as the run went):
the same ids, parents, names and `gen_ai.*` attributes, with the times moved from the
trace's monotonic clock to the wall clock by meta.json's anchor, as OpenTelemetry
wants. They go out through the SDK's own OTLP/HTTP exporter, in batches, so a
collector sees exactly what a live run with `--otlp-endpoint` would have sent.
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tracing.otel import REQUEST_SPAN, mono_to_unix, otlp_exporter, traces_url
from tracing.reader import Trace, TraceError

BATCH = 512  # spans per export call (the SDK's BatchSpanProcessor default)
REACH_TIMEOUT_S = 5.0  # a TCP connect to the collector, before any span is built for it


@dataclass(slots=True)
class Replayed:
    spans: int
    requests: int


def replay_spans(root: str | Path, endpoint: str) -> Replayed:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

    trace = Trace.open(root)
    if not trace.has_table("spans"):
        raise TraceError(f"{root} has no spans table (a run with --no-probes, or from before spans)")
    clock = trace.meta.get("clock") or {}
    if "anchor_monotonic_ns" not in clock or "anchor_unix_ns" not in clock:
        raise TraceError(f"{root}: meta.json has no clock anchor, so its spans cannot be put on the wall clock")
    anchor = (int(clock["anchor_monotonic_ns"]), int(clock["anchor_unix_ns"]))
    rows = trace.table("spans").to_pylist()
    _reach(endpoint)
    exporter = otlp_exporter(endpoint)
    resource = Resource.create({"service.name": trace.meta.get("service_name", "mstrace")})
    scope = InstrumentationScope("mstrace")
    flags = TraceFlags(TraceFlags.SAMPLED)
    spans = []
    for r in rows:
        ctx = SpanContext(int(r["trace_id"], 16), int(r["span_id"], 16), is_remote=False, trace_flags=flags)
        parent = (SpanContext(int(r["trace_id"], 16), int(r["parent_span_id"], 16), is_remote=False,
                              trace_flags=flags) if r["parent_span_id"] else None)
        spans.append(ReadableSpan(
            name=str(r["name"]), context=ctx, parent=parent, resource=resource,
            attributes=json.loads(r["attributes"] or "{}"),
            kind=SpanKind.SERVER if r["name"] == REQUEST_SPAN else SpanKind.INTERNAL,
            start_time=mono_to_unix(int(r["start_ns"]), anchor), end_time=mono_to_unix(int(r["end_ns"]), anchor),
            instrumentation_scope=scope))
    # the exporter logs each retry ("Transient error ..."); the one line is ours
    log = logging.getLogger("opentelemetry.exporter.otlp")
    level, log.level = log.level, logging.CRITICAL
    try:
        for at in range(0, len(spans), BATCH):
            if exporter.export(spans[at:at + BATCH]) != SpanExportResult.SUCCESS:
                raise OSError(f"the collector at {endpoint} refused the spans (or could not be reached)")
    finally:
        exporter.shutdown()
        log.setLevel(level)
    return Replayed(len(spans), sum(1 for r in rows if r["name"] == REQUEST_SPAN))


def _reach(endpoint: str) -> None:
    """A collector that is not there is one line at once, not the exporter's retries with
    backoff (seconds of "Transient error" lines)."""
    u = urlsplit(traces_url(endpoint))
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname or "localhost", port), timeout=REACH_TIMEOUT_S):
            pass
    except OSError as e:
        raise OSError(f"cannot reach the collector at {endpoint}: {e.strerror or e}") from None
