"""OTLP trace requests (protobuf or JSON) decoded into spans, and vLLM's and SGLang's request
spans into `requests` rows.

vLLM (vllm/v1/engine/output_processor.py `OutputProcessor.do_tracing`; attribute names in
vllm/tracing/utils.py `SpanAttributes`): one span per finished request, `llm_request`, from
the request's arrival to when its last output was handled; latencies are float seconds:
`gen_ai.latency.time_to_first_token`, `gen_ai.latency.e2e`, `gen_ai.latency.time_in_queue`,
`gen_ai.latency.time_in_model_prefill` / `_decode` / `_inference`; token counts
`gen_ai.usage.prompt_tokens` / `completion_tokens`; `gen_ai.request.id`;
`gen_ai.response.finish_reasons` (a JSON array as text).
SGLang (python/sglang/srt/observability/trace.py, request_tracing.py `make_span_attrs`):
a root span per request named `<role> Req <rid8>` with attribute `rid`, stage spans below it;
newer versions set the same `gen_ai.*` names on the root, except `gen_ai.latency.e2e`
(built before the request's finish time is known): E2E is then the root span's length.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from typing import Any

REQUEST_SPAN = "llm_request"  # vLLM's name
SGLANG_ROOT = re.compile(r"(^|\s)Req [0-9A-Za-z-]+$")
# vLLM's and SGLang's finish reasons, in the trace's words (docs/trace-schema.md)
FINISH = {"stop": "eos", "length": "length", "abort": "aborted"}


class OtlpError(ValueError):
    """The body is not an OTLP trace export: a 400 for the sender."""


@dataclass(slots=True)
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def request_id(self) -> str | None:
        """The engine's request id, where this is a request's span (vLLM's, or SGLang's root)."""
        a = self.attributes
        if self.name == REQUEST_SPAN or (SGLANG_ROOT.search(self.name) and not self.parent_span_id) or \
                ("gen_ai.request.id" in a and "gen_ai.latency.time_to_first_token" in a):
            rid = a.get("gen_ai.request.id", a.get("rid"))
            return None if rid is None else str(rid)
        return None


def decode(body: bytes, content_type: str) -> list[Span]:
    """The spans of one ExportTraceServiceRequest (application/x-protobuf or application/json)."""
    if "json" in content_type:
        try:
            doc = json.loads(body)
        except ValueError as e:
            raise OtlpError(f"not JSON: {e}") from None
        return _from_json(doc)
    try:
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
    except ImportError:  # pragma: no cover - the otlp extra
        raise OtlpError("this collector cannot read protobuf: pip install 'mstrace[otlp]'") from None
    try:
        req = ExportTraceServiceRequest.FromString(body)
    except DecodeError as e:
        raise OtlpError(f"not an OTLP protobuf ExportTraceServiceRequest: {e}") from None
    out = []
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                                int(s.start_time_unix_nano), int(s.end_time_unix_nano),
                                {kv.key: _pb_value(kv.value) for kv in s.attributes}))
    if not out and not body.strip():
        return out
    if not out and not req.resource_spans:
        raise OtlpError("not an OTLP trace export: no resourceSpans")
    return out


def _pb_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_pb_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _pb_value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind else None


def _from_json(doc: Any) -> list[Span]:
    """OTLP/JSON (the protobuf mapping with hex trace and span ids, int64 as strings)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans"), list):
        raise OtlpError("not an OTLP trace export: no resourceSpans")
    out = []
    try:
        for rs in doc["resourceSpans"]:
            for ss in rs.get("scopeSpans") or []:
                for s in ss.get("spans") or []:
                    out.append(Span(_id(s.get("traceId")), _id(s.get("spanId")), _id(s.get("parentSpanId")),
                                    str(s.get("name", "")), int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"]),
                                    {a["key"]: _json_value(a.get("value") or {}) for a in s.get("attributes") or []}))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise OtlpError(f"not an OTLP trace export: a span without {e}") from None
    return out


def _id(v: Any) -> str:
    if not v:
        return ""
    s = str(v)
    if re.fullmatch(r"[0-9a-fA-F]+", s):
        return s.lower()
    return base64.b64decode(s).hex()  # a JSON encoder that kept protobuf's base64


def _json_value(v: dict[str, Any]) -> Any:
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return [_json_value(x) for x in (v["arrayValue"].get("values") or [])]
    return None


def request_row(s: Span) -> tuple[Any, ...] | None:
    """A `requests` row (tracing/schema.py order) of a request's span, or None."""
    rid = s.request_id
    if rid is None:
        return None
    a = s.attributes

    def secs(key: str) -> int | None:
        v = a.get(key)
        return None if v is None else round(float(v) * 1e9)

    ttft, e2e, prefill = secs("gen_ai.latency.time_to_first_token"), secs("gen_ai.latency.e2e"), \
        secs("gen_ai.latency.time_in_model_prefill")
    arrival = s.start_ns
    first = arrival + ttft if ttft is not None else 0
    finish = arrival + e2e if e2e is not None else s.end_ns
    reasons = a.get("gen_ai.response.finish_reasons")
    try:
        raw = json.loads(reasons)[0] if isinstance(reasons, str) else (reasons or [""])[0]
    except (ValueError, IndexError, TypeError):
        raw = str(reasons or "")
    prompt, out = int(a.get("gen_ai.usage.prompt_tokens") or 0), int(a.get("gen_ai.usage.completion_tokens") or 0)
    return (rid, [], [], "", prompt, out, int(a.get("gen_ai.usage.cached_tokens") or 0),
            FINISH.get(raw, raw or "unknown"), str(raw), arrival, 0, 0, 0,
            first - prefill if first and prefill is not None else 0, first, finish, 0, 0, [], [], 0, [])


def span_row(s: Span) -> tuple[Any, ...]:
    """A `spans` row: the span as received, its request id where it has one."""
    rid = s.request_id or str(s.attributes.get("rid", "") or "")
    return (s.trace_id, s.span_id, s.parent_span_id, s.name, rid, s.start_ns, s.end_ns, s.end_ns - s.start_ns,
            json.dumps(s.attributes, default=str))
