"""`mstrace export TRACE --otlp URL`: replay a trace's request spans to an OTLP collector.

The spans are the rows of `TRACE/spans/` (tracing/otel.py wrote them as the run went):
the same ids, parents, names and `gen_ai.*` attributes, with the times moved from the
trace's monotonic clock to the wall clock by meta.json's anchor, as OpenTelemetry
wants. They go out through the SDK's own OTLP/HTTP exporter, in batches, so a
collector sees exactly what a live run with `--otlp-endpoint` would have sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tracing.otel import REQUEST_SPAN, mono_to_unix, otlp_exporter
from tracing.reader import Trace, TraceError

BATCH = 512  # spans per export call (the SDK's BatchSpanProcessor default)


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
    try:
        for at in range(0, len(spans), BATCH):
            if exporter.export(spans[at:at + BATCH]) != SpanExportResult.SUCCESS:
                raise OSError(f"the collector at {endpoint} refused the spans (or could not be reached)")
    finally:
        exporter.shutdown()
    return Replayed(len(spans), sum(1 for r in rows if r["name"] == REQUEST_SPAN))
