"""Request-level OpenTelemetry spans (tracing/otel.py): structure, attributes,
clocks, the Parquet exporter, the OTLP extra, and `mstrace run` end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from scheduler.hops.sender import FinishedRecord
from tests.support.cli import mstrace
from tests.support.otlp_receiver import Receiver, receiver
from tracing.otel import (
    REQUEST_SPAN,
    OtlpUnavailableError,
    ParquetSpanExporter,
    SpanSink,
    mono_to_unix,
    request_spans,
    traces_url,
    unix_to_mono,
)
from tracing.reader import read_table
from tracing.writer import TraceWriter

# A realistic anchor: monotonic ~ days of uptime, unix ~ 2025.
ANCHOR = (123_456_789_012_345, 1_750_000_000_123_456_789)
T0 = ANCHOR[0] + 5_000_000_000  # requests arrive 5 s after the anchor was taken
MS = 1_000_000
OTLP_MODULE = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def record(rid: str = "r0", **kw: object) -> FinishedRecord:
    """A finished request: arrival T0, tokenized +1 ms, queued +2, admitted +5,
    first scheduled +6, first token +40, finish +200; 3-token prompt, 2 out."""
    fields: dict[str, object] = dict(
        request_id=rid, input_ids=[1, 2, 3], output_ids=[7, 8], cached_prefix_len=16,
        finish_reason="length", finish_detail="", arrival_ns=T0, tokenized_ns=T0 + 1 * MS,
        queued_ns=T0 + 2 * MS, admitted_ns=T0 + 5 * MS, first_scheduled_ns=T0 + 6 * MS,
        first_token_ns=T0 + 40 * MS, finish_ns=T0 + 200 * MS, num_preemptions=0,
        num_prefill_chunks=1, token_ns=[T0 + 40 * MS, T0 + 200 * MS],
    )
    fields.update(kw)
    return FinishedRecord(**fields)  # type: ignore[arg-type]


def rejected(rid: str = "bad") -> FinishedRecord:
    return record(rid, output_ids=[], cached_prefix_len=0, finish_reason="rejected",
                  finish_detail="prompt needs 99 blocks; pool has 8", admitted_ns=0,
                  first_scheduled_ns=0, first_token_ns=0, finish_ns=T0 + 3 * MS, token_ns=[])


@pytest.fixture
def memory_tracer():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def by_name(spans):
    return {s.name: s for s in spans}


def test_root_and_stage_children(memory_tracer):
    tracer, exp = memory_tracer
    request_spans(tracer, record(), ANCHOR)
    spans = exp.get_finished_spans()
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 1 and roots[0].name == REQUEST_SPAN and roots[0].kind is SpanKind.SERVER
    root = roots[0]
    children = sorted((s for s in spans if s.parent is not None), key=lambda s: s.start_time)
    assert [c.name for c in children] == ["tokenize", "queue", "prefill", "decode"]
    for c in children:
        assert c.parent.span_id == root.context.span_id
        assert c.context.trace_id == root.context.trace_id
        assert c.attributes["gen_ai.request.id"] == "r0"
        assert root.start_time <= c.start_time <= c.end_time <= root.end_time
    s = by_name(spans)
    expect = {"tokenize": (0, 1), "queue": (2, 5), "prefill": (6, 40), "decode": (40, 200)}
    for name, (a, b) in expect.items():
        assert (s[name].start_time, s[name].end_time) == \
            (mono_to_unix(T0 + a * MS, ANCHOR), mono_to_unix(T0 + b * MS, ANCHOR))
    assert (root.start_time, root.end_time) == \
        (mono_to_unix(T0, ANCHOR), mono_to_unix(T0 + 200 * MS, ANCHOR))
    # Wall clock, not monotonic: what a collector expects (2025, not boot-relative).
    assert root.start_time == ANCHOR[1] + 5_000_000_000


def test_root_attributes_use_vllm_names(memory_tracer):
    tracer, exp = memory_tracer
    request_spans(tracer, record(num_preemptions=0), ANCHOR)
    a = dict(by_name(exp.get_finished_spans())[REQUEST_SPAN].attributes)
    assert a == {
        "gen_ai.request.id": "r0",
        "gen_ai.usage.prompt_tokens": 3,
        "gen_ai.usage.completion_tokens": 2,
        "gen_ai.latency.time_in_queue": pytest.approx(0.003),
        "gen_ai.latency.time_to_first_token": pytest.approx(0.040),
        "gen_ai.latency.e2e": pytest.approx(0.200),
        "gen_ai.latency.time_in_model_prefill": pytest.approx(0.034),
        "gen_ai.latency.time_in_model_decode": pytest.approx(0.160),
        "gen_ai.latency.time_in_model_inference": pytest.approx(0.194),
        "mstrace.finish_reason": "length",
        "mstrace.cached_prefix_tokens": 16,
        "mstrace.num_preemptions": 0,
    }
    assert all(isinstance(v, float) for k, v in a.items() if k.startswith("gen_ai.latency."))


def test_rejected_request_skips_stages_that_never_happened(memory_tracer):
    tracer, exp = memory_tracer
    request_spans(tracer, rejected(), ANCHOR)
    spans = exp.get_finished_spans()
    assert sorted(s.name for s in spans) == [REQUEST_SPAN, "tokenize"]
    a = by_name(spans)[REQUEST_SPAN].attributes
    assert a["mstrace.finish_reason"] == "rejected"
    assert a["mstrace.finish_detail"].startswith("prompt needs")
    assert a["gen_ai.latency.e2e"] == pytest.approx(0.003)
    assert a["gen_ai.usage.completion_tokens"] == 0
    for missing in ("time_in_queue", "time_to_first_token", "time_in_model_prefill",
                    "time_in_model_decode", "time_in_model_inference"):
        assert f"gen_ai.latency.{missing}" not in a


def test_preempted_request_queue_ends_at_first_schedule(memory_tracer):
    # admitted_ns is re-stamped on re-admission, past the first round: the queue
    # stage must not stretch over prefill and decode.
    tracer, exp = memory_tracer
    request_spans(tracer, record(admitted_ns=T0 + 100 * MS, num_preemptions=1), ANCHOR)
    s = by_name(exp.get_finished_spans())
    assert s["queue"].end_time == mono_to_unix(T0 + 6 * MS, ANCHOR)
    assert s[REQUEST_SPAN].attributes["gen_ai.latency.time_in_queue"] == pytest.approx(0.004)
    assert s[REQUEST_SPAN].attributes["mstrace.num_preemptions"] == 1


def test_each_request_is_its_own_trace(memory_tracer):
    tracer, exp = memory_tracer
    for i in range(3):
        request_spans(tracer, record(f"r{i}"), ANCHOR)
    roots = [s for s in exp.get_finished_spans() if s.parent is None]
    assert len({r.context.trace_id for r in roots}) == 3


@pytest.mark.parametrize("mono", [0, 1, T0, ANCHOR[0], 2**62 + 12345, ANCHOR[0] - 987_654_321])
def test_clock_round_trip_is_exact(mono):
    assert unix_to_mono(mono_to_unix(mono, ANCHOR), ANCHOR) == mono
    assert mono_to_unix(mono, ANCHOR) - mono_to_unix(ANCHOR[0], ANCHOR) == mono - ANCHOR[0]


def test_parquet_exporter_round_trip(tmp_path):
    writer = TraceWriter(tmp_path)
    writer.write_meta({})
    sink = SpanSink(writer, ANCHOR)
    recs = [record("a"), rejected("b"), record("c", num_preemptions=2, admitted_ns=T0 + 50 * MS)]
    for r in recs:
        sink.on_text(r.request_id, "ignored")
        sink.on_finish(r, "text")
    sink.close()
    sink.close()  # idempotent
    writer.close()
    t = read_table(tmp_path, "spans").to_pylist()
    assert len(t) == 5 + 2 + 5
    roots = {row["request_id"]: row for row in t if row["parent_span_id"] == ""}
    assert set(roots) == {"a", "b", "c"}
    for rec in recs:
        root = roots[rec.request_id]
        # Back on the trace's monotonic clock, exactly: joins with requests/timeline.
        assert (root["start_ns"], root["end_ns"]) == (rec.arrival_ns, rec.finish_ns)
        assert root["name"] == REQUEST_SPAN and root["dur_ns"] == rec.finish_ns - rec.arrival_ns
        assert len(root["trace_id"]) == 32 and len(root["span_id"]) == 16
        attrs = json.loads(root["attributes"])
        assert attrs["gen_ai.request.id"] == rec.request_id
        assert attrs["gen_ai.usage.prompt_tokens"] == 3
        kids = [row for row in t if row["parent_span_id"] == root["span_id"]]
        assert all(k["trace_id"] == root["trace_id"] and k["request_id"] == rec.request_id
                   for k in kids)
        assert all(k["dur_ns"] == k["end_ns"] - k["start_ns"] >= 0 for k in kids)
    a_kids = {row["name"]: row for row in t if row["parent_span_id"] == roots["a"]["span_id"]}
    assert (a_kids["prefill"]["start_ns"], a_kids["prefill"]["end_ns"]) == (T0 + 6 * MS, T0 + 40 * MS)
    assert [row["name"] for row in t if row["parent_span_id"] == roots["b"]["span_id"]] == ["tokenize"]


def test_exporter_refuses_after_shutdown(tmp_path):
    writer = TraceWriter(tmp_path)
    writer.write_meta({})
    exp = ParquetSpanExporter(writer, ANCHOR)
    exp.shutdown()
    assert exp.export([]) is SpanExportResult.FAILURE
    writer.close()


def test_span_cost_per_request_is_small(tmp_path):
    """Measured cost of one request's spans (root + 4 stages, Parquet export)."""
    writer = TraceWriter(tmp_path, flush_interval_s=60)
    writer.write_meta({})
    sink = SpanSink(writer, ANCHOR)
    recs = [record(f"r{i}") for i in range(2000)]
    for r in recs[:200]:  # warm up
        sink.on_finish(r, "")
    t = time.perf_counter()
    for r in recs[200:]:
        sink.on_finish(r, "")
    us = (time.perf_counter() - t) / 1800 * 1e6
    sink.close()
    writer.close()
    print(f"span cost: {us:.1f} us/request")
    # A tiny-model request takes milliseconds; a real one, hundreds of them.
    # The bound is loose so a loaded CI box does not flake; typical is ~40 us.
    assert us < 2000


def test_otlp_endpoint_gets_traces_path():
    assert traces_url("http://localhost:4318") == "http://localhost:4318/v1/traces"
    assert traces_url("http://localhost:4318/") == "http://localhost:4318/v1/traces"
    assert traces_url("http://c:4318/custom/v1/traces") == "http://c:4318/custom/v1/traces"


def test_missing_otlp_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, OTLP_MODULE, None)  # makes the import raise ImportError
    writer = TraceWriter(tmp_path)
    writer.write_meta({})
    try:
        with pytest.raises(OtlpUnavailableError) as e:
            SpanSink(writer, ANCHOR, "http://localhost:4318")
    finally:
        writer.close()
    msg = str(e.value)
    assert "\n" not in msg and "pip install 'mstrace[otlp]'" in msg


@pytest.mark.skipif(importlib.util.find_spec("opentelemetry.exporter") is not None
                    and importlib.util.find_spec(OTLP_MODULE) is not None,
                    reason="the OTLP exporter is installed here")
def test_cli_missing_otlp_package_fails_before_writing(tmp_path):
    out = tmp_path / "t"
    p = mstrace("run", "--model", "tiny", "--requests", "2", "-q", "--out", str(out),
                "--otlp-endpoint", "http://127.0.0.1:4318")
    assert p.returncode == 2
    assert "pip install 'mstrace[otlp]'" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()


def test_otlp_export_reaches_a_collector(tmp_path):
    pytest.importorskip(OTLP_MODULE, reason="needs mstrace[otlp]")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    with receiver() as url:
        writer = TraceWriter(tmp_path)
        writer.write_meta({})
        sink = SpanSink(writer, ANCHOR, url)
        sink.on_finish(record("otlp-1"), "")
        sink.close()  # flushes the batch processor
        writer.close()
    assert Receiver.posts and all(path == "/v1/traces" for path, _, _ in Receiver.posts)
    spans = []
    for _, _, body in Receiver.posts:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            svc = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
            assert svc == "mstrace"
            spans += [s for ss in rs.scope_spans for s in ss.spans]
    root = next(s for s in spans if s.name == REQUEST_SPAN)
    assert root.start_time_unix_nano == mono_to_unix(T0, ANCHOR)  # wall clock on the wire
    assert sorted(s.name for s in spans) == sorted([REQUEST_SPAN, "tokenize", "queue", "prefill", "decode"])
    assert read_table(tmp_path, "spans").num_rows == 5  # the Parquet copy is still written


def test_run_writes_spans_per_request(tmp_path):
    out = tmp_path / "t"
    p = mstrace("run", "--model", "tiny", "--requests", "4", "-q", "--out", str(out))
    assert p.returncode == 0, p.stderr
    req = read_table(out, "requests").to_pylist()
    spans = read_table(out, "spans").to_pylist()
    assert len(req) == 4
    roots = {s["request_id"]: s for s in spans if s["parent_span_id"] == ""}
    assert set(roots) == {r["request_id"] for r in req}
    assert all(s["name"] == REQUEST_SPAN for s in roots.values())
    for r in req:
        root = roots[r["request_id"]]
        # Same clock as the requests table: the root is exactly arrival -> finish.
        assert (root["start_ns"], root["end_ns"]) == (r["arrival_ns"], r["finish_ns"])
        kids = sorted((s for s in spans if s["parent_span_id"] == root["span_id"]),
                      key=lambda s: s["start_ns"])
        assert [k["name"] for k in kids] == ["tokenize", "queue", "prefill", "decode"]
        assert all(k["trace_id"] == root["trace_id"] for k in kids)
        assert all(root["start_ns"] <= k["start_ns"] <= k["end_ns"] <= root["end_ns"] for k in kids)
        a = json.loads(root["attributes"])
        assert a["gen_ai.request.id"] == r["request_id"]
        assert a["gen_ai.usage.prompt_tokens"] == r["prompt_len"]
        assert a["gen_ai.usage.completion_tokens"] == r["output_len"]
        assert a["gen_ai.latency.e2e"] == pytest.approx((r["finish_ns"] - r["arrival_ns"]) / 1e9)
        assert a["gen_ai.latency.time_to_first_token"] == \
            pytest.approx((r["first_token_ns"] - r["arrival_ns"]) / 1e9)
        for k in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode"):
            assert a[f"gen_ai.latency.{k}"] >= 0
        assert a["mstrace.finish_reason"] == r["finish_reason"]
    assert len(spans) == 4 * 5
