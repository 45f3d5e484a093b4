"""Request-level OpenTelemetry spans, built off the hot path.

The scheduling thread only stamps integers (CLOCK_MONOTONIC ns) on a request.
When the request finishes, the sender thread turns those stamps into one
`llm_request` root span with a child per lifecycle stage, through the real
OpenTelemetry SDK. Building spans once at finish, with explicit start and end
times, is vLLM's approach too (OutputProcessor.do_tracing): no span objects
live across scheduling rounds and no OTel call ever runs on the scheduling
thread.

Every span goes to the trace's own `spans` table (ParquetSpanExporter, times
converted back to the monotonic clock so they join with the other tables) and,
when an endpoint is given, to an OTLP collector (Jaeger, Tempo, ...) with wall
clock times, as OpenTelemetry requires.

No torch here: tracing/ must stay importable by the analyses.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

from tracing.writer import TraceWriter

REQUEST_SPAN = "llm_request"

# (anchor_monotonic_ns, anchor_unix_ns), as probes.clock.wall_anchor() returns it
# and meta.json records it under "clock".
ClockAnchor = tuple[int, int]


class SpanAttributes:
    """Attribute names. The gen_ai.* ones are exactly vLLM's (vllm/tracing.py,
    class SpanAttributes), so dashboards built for vLLM traces read ours."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # Ours: scheduler facts vLLM's span does not carry.
    FINISH_REASON = "mstrace.finish_reason"
    FINISH_DETAIL = "mstrace.finish_detail"
    CACHED_PREFIX_TOKENS = "mstrace.cached_prefix_tokens"
    NUM_PREEMPTIONS = "mstrace.num_preemptions"


class FinishedRequest(Protocol):
    """What spans need from a finished request. scheduler.hops.sender.FinishedRecord
    satisfies it; a protocol keeps tracing/ free of scheduler imports."""

    @property
    def request_id(self) -> str: ...
    @property
    def input_ids(self) -> list[int]: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def cached_prefix_len(self) -> int: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def finish_detail(self) -> str: ...
    @property
    def arrival_ns(self) -> int: ...
    @property
    def tokenized_ns(self) -> int: ...
    @property
    def queued_ns(self) -> int: ...
    @property
    def admitted_ns(self) -> int: ...
    @property
    def first_scheduled_ns(self) -> int: ...
    @property
    def first_token_ns(self) -> int: ...
    @property
    def finish_ns(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...


def mono_to_unix(ns: int, anchor: ClockAnchor) -> int:
    # Integer arithmetic on both sides makes the round trip exact.
    return ns - anchor[0] + anchor[1]


def unix_to_mono(ns: int, anchor: ClockAnchor) -> int:
    return ns - anchor[1] + anchor[0]


def _queue_end(r: FinishedRequest) -> int:
    # admitted_ns is re-stamped on every re-admission after a preemption, so for
    # a preempted request it can lie past its first round. Its first admission
    # was in the round that stamped first_scheduled_ns, so cap the queue stage
    # there (vLLM's time_in_queue likewise ends at the first scheduling).
    if r.first_scheduled_ns and (not r.admitted_ns or r.admitted_ns > r.first_scheduled_ns):
        return r.first_scheduled_ns
    return r.admitted_ns


def _stages(r: FinishedRequest) -> list[tuple[str, int, int]]:
    """(name, start_ns, end_ns) of each stage that happened, in order."""
    out: list[tuple[str, int, int]] = []
    for name, start, end in (
        ("tokenize", r.arrival_ns, r.tokenized_ns),
        ("queue", r.queued_ns, _queue_end(r)),
        ("prefill", r.first_scheduled_ns, r.first_token_ns),
        ("decode", r.first_token_ns, r.finish_ns),
    ):
        # 0 means "never happened" (a rejected request is never admitted).
        if start and end and end >= start:
            out.append((name, start, end))
    return out


def _s(ns: int) -> float:
    return ns / 1e9


def request_attributes(r: FinishedRequest) -> dict[str, AttributeValue]:
    """The root span's attributes; latencies in seconds (floats), as vLLM's."""
    a = SpanAttributes
    attrs: dict[str, AttributeValue] = {
        a.GEN_AI_REQUEST_ID: r.request_id,
        a.GEN_AI_USAGE_PROMPT_TOKENS: len(r.input_ids),
        a.GEN_AI_USAGE_COMPLETION_TOKENS: len(r.output_ids),
        a.FINISH_REASON: r.finish_reason,
        a.CACHED_PREFIX_TOKENS: r.cached_prefix_len,
        a.NUM_PREEMPTIONS: r.num_preemptions,
    }
    if r.finish_detail:
        attrs[a.FINISH_DETAIL] = r.finish_detail
    queue_end = _queue_end(r)
    if r.queued_ns and queue_end:
        attrs[a.GEN_AI_LATENCY_TIME_IN_QUEUE] = _s(queue_end - r.queued_ns)
    if r.arrival_ns and r.first_token_ns:
        attrs[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = _s(r.first_token_ns - r.arrival_ns)
    if r.arrival_ns and r.finish_ns:
        attrs[a.GEN_AI_LATENCY_E2E] = _s(r.finish_ns - r.arrival_ns)
    if r.first_scheduled_ns and r.first_token_ns:
        attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = _s(r.first_token_ns - r.first_scheduled_ns)
    if r.first_token_ns and r.finish_ns:
        attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = _s(r.finish_ns - r.first_token_ns)
    if r.first_scheduled_ns and r.finish_ns:
        attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = _s(r.finish_ns - r.first_scheduled_ns)
    return attrs


def request_spans(tracer: Tracer, r: FinishedRequest, anchor: ClockAnchor) -> list[Span]:
    """Create and end one request's spans: the `llm_request` root, then its stages.

    The root covers every recorded instant of the request (arrival to finish);
    each child covers one stage. All times are given explicitly, converted from
    the trace's monotonic clock to wall clock with `anchor`.
    """
    stamps = [t for t in (r.arrival_ns, r.tokenized_ns, r.queued_ns, r.admitted_ns,
                          r.first_scheduled_ns, r.first_token_ns, r.finish_ns) if t]
    start, end = (min(stamps), max(stamps)) if stamps else (0, 0)
    root = tracer.start_span(
        REQUEST_SPAN, kind=SpanKind.SERVER, attributes=request_attributes(r),
        start_time=mono_to_unix(start, anchor),
    )
    ctx = trace.set_span_in_context(root)
    # Children repeat the request id so each row of the spans table, and each
    # span in a collector's search, names its request on its own.
    child_attrs: dict[str, AttributeValue] = {SpanAttributes.GEN_AI_REQUEST_ID: r.request_id}
    spans: list[Span] = [root]
    for name, s, e in _stages(r):
        child = tracer.start_span(name, context=ctx, kind=SpanKind.INTERNAL,
                                  attributes=child_attrs, start_time=mono_to_unix(s, anchor))
        child.end(end_time=mono_to_unix(e, anchor))
        spans.append(child)
    root.end(end_time=mono_to_unix(end, anchor))
    return spans


class ParquetSpanExporter(SpanExporter):
    """Writes each exported span as a row of the trace's `spans` table.

    Rows go to this exporter's own TraceWriter buffer, which must have a single
    producer: the sender thread under a SimpleSpanProcessor (as SpanSink uses it).
    """

    def __init__(self, writer: TraceWriter, anchor: ClockAnchor) -> None:
        self._buf = writer.buffer("spans")
        self._anchor = anchor
        self._shutdown = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        for sp in spans:
            ctx = sp.context
            if ctx is None or sp.start_time is None or sp.end_time is None:
                continue  # not a finished, valid span: nothing to place on the clock
            start = unix_to_mono(sp.start_time, self._anchor)
            end = unix_to_mono(sp.end_time, self._anchor)
            attrs = dict(sp.attributes or {})
            rid = attrs.get(SpanAttributes.GEN_AI_REQUEST_ID, "")
            self._buf.append((
                trace.format_trace_id(ctx.trace_id),
                trace.format_span_id(ctx.span_id),
                trace.format_span_id(sp.parent.span_id) if sp.parent is not None else "",
                sp.name,
                rid if isinstance(rid, str) else str(rid),
                start,
                end,
                end - start,
                json.dumps(attrs, separators=(",", ":")),
            ))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        # The TraceWriter owns the files and flushes them on its own close().
        self._shutdown = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class OtlpUnavailableError(RuntimeError):
    """The OTLP exporter package is not installed. str(e) is a one-line message."""


def otlp_exporter(endpoint: str) -> SpanExporter:
    """An OTLP/HTTP span exporter for `endpoint`, imported lazily (optional extra)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise OtlpUnavailableError(
            "--otlp-endpoint needs the OTLP exporter: pip install 'mstrace[otlp]'"
        ) from None
    exporter: SpanExporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
    return exporter


def traces_url(endpoint: str) -> str:
    """A collector base URL gets OTLP/HTTP's traces path appended.

    The exporter uses a constructor endpoint verbatim, so `http://host:4318`
    would post to `/` and be refused; users (and vLLM's flag) give the base.
    """
    if urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


class SpanSink:
    """An OutputSink: builds each finished request's spans on the sender thread.

    Parquet export is synchronous (a tuple append); OTLP export goes through a
    BatchSpanProcessor so network I/O happens on the SDK's worker thread, never
    on the sender thread and never on the scheduling thread.
    """

    def __init__(
        self,
        writer: TraceWriter,
        anchor: ClockAnchor,
        otlp_endpoint: str | None = None,
        service_name: str = "mstrace",
    ) -> None:
        # First, so a missing package fails before anything is started.
        otlp = otlp_exporter(otlp_endpoint) if otlp_endpoint else None
        self._anchor = anchor
        # ALWAYS_ON, not the env-configurable default: the spans table is part
        # of the trace and must hold every request. shutdown_on_exit=False:
        # close() is the one shutdown, run while the writer is still open.
        self._provider = TracerProvider(
            sampler=ALWAYS_ON, resource=Resource.create({"service.name": service_name}),
            shutdown_on_exit=False,
        )
        self._provider.add_span_processor(SimpleSpanProcessor(ParquetSpanExporter(writer, anchor)))
        if otlp is not None:
            self._provider.add_span_processor(BatchSpanProcessor(otlp))
        self._tracer = self._provider.get_tracer("mstrace")
        self._closed = False

    def on_text(self, request_id: str, text: str) -> None:
        pass

    def on_finish(self, record: FinishedRequest, text: str) -> None:
        request_spans(self._tracer, record, self._anchor)

    def close(self) -> None:
        """Flush and shut down; call after the engine (its sender) is closed and
        before the TraceWriter is, so the last spans reach the table."""
        if self._closed:
            return
        self._closed = True
        self._provider.force_flush()
        self._provider.shutdown()
