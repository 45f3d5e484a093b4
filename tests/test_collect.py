"""`mstrace collect`: vLLM's and SGLang's request spans, sent by the real OTLP/HTTP exporter
(opentelemetry-exporter-otlp-proto-http), become a trace whose `report` latencies are the
spans' own and whose `diff` pairs requests by id."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.cli import REPO, mstrace

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

S = 1_000_000_000


@contextmanager
def collector(out: Path) -> Iterator[str]:
    """A running `mstrace collect --otlp-port 0`; its /v1/traces URL. Ctrl-C ends it, exit 0."""
    p = subprocess.Popen([sys.executable, "-m", "viewer.cli", "collect", "--otlp-port", "0", "--out", str(out)],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline() if p.stderr else ""
        m = re.search(r"(http://127\.0\.0\.1:\d+/v1/traces)", line)
        assert m, line + (p.stderr.read() if p.stderr else "")
        yield m.group(1)
    finally:
        p.send_signal(signal.SIGINT)
        out_s, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert "requests" in out_s


def export(url: str, send: Callable[[Any], None], gzip: bool = False) -> None:
    """Spans through the OpenTelemetry SDK and its OTLP/HTTP (protobuf) exporter, as an engine
    sends them (`gzip`: compressed, as the OpenTelemetry Collector's otlphttp exporter does)."""
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    compression = Compression.Gzip if gzip else Compression.NoCompression
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, compression=compression)))
    send(provider.get_tracer("engine"))
    provider.shutdown()  # flushes every span before it returns


def workload(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    t0 = 1_780_000_000 * S
    out = []
    for i in range(n):
        arrival = t0 + int(rng.integers(0, 5 * S))
        ttft = float(rng.uniform(0.01, 0.4))
        e2e = ttft + float(rng.uniform(0.1, 2.0))
        out.append({"rid": f"req-{i:03d}", "arrival": arrival, "ttft": ttft, "e2e": e2e,
                    "prompt": int(rng.integers(16, 512)), "completion": int(rng.integers(8, 128))})
    return out


def vllm_spans(reqs: list[dict]) -> Callable[[Any], None]:
    """vLLM's llm_request span (vllm/v1/engine/output_processor.py do_tracing)."""
    from opentelemetry.trace import SpanKind

    def send(tracer: Any) -> None:
        for r in reqs:
            s = tracer.start_span("llm_request", kind=SpanKind.SERVER, start_time=r["arrival"], attributes={
                "gen_ai.request.id": r["rid"], "gen_ai.usage.prompt_tokens": r["prompt"],
                "gen_ai.usage.completion_tokens": r["completion"], "gen_ai.request.max_tokens": 128,
                "gen_ai.latency.time_to_first_token": r["ttft"], "gen_ai.latency.e2e": r["e2e"],
                "gen_ai.latency.time_in_queue": r["ttft"] / 4, "gen_ai.latency.time_in_model_prefill": r["ttft"] / 2,
                "gen_ai.latency.time_in_model_decode": r["e2e"] - r["ttft"],
                "gen_ai.latency.time_in_model_inference": r["e2e"] - r["ttft"] / 2,
                "gen_ai.response.finish_reasons": json.dumps(["stop"])})
            s.end(end_time=r["arrival"] + int(r["e2e"] * S) + 50_000)
    return send


def sglang_spans(reqs: list[dict]) -> Callable[[Any], None]:
    """SGLang's request tree (python/sglang/srt/observability/trace.py): a root `Req <rid8>` with
    `rid` and gen_ai.* (no e2e: the root's length is it), a thread span, stage spans."""
    from opentelemetry import trace

    def send(tracer: Any) -> None:
        for r in reqs:
            end = r["arrival"] + int(r["e2e"] * S)
            root = tracer.start_span(f" Req {r['rid'][-8:]}", start_time=r["arrival"], attributes={
                "rid": r["rid"], "module": "sglang::request", "gen_ai.request.id": r["rid"],
                "gen_ai.usage.prompt_tokens": r["prompt"], "gen_ai.usage.completion_tokens": r["completion"],
                "gen_ai.latency.time_to_first_token": r["ttft"],
                "gen_ai.response.finish_reasons": json.dumps(["length"])})
            ctx = trace.set_span_in_context(root)
            th = tracer.start_span("scheduler [TP 0] (host:abcd | pid:1)", context=ctx, start_time=r["arrival"])
            tctx = trace.set_span_in_context(th)
            first = r["arrival"] + int(r["ttft"] * S)
            for name, a, b in (("prefill_forward", r["arrival"], first), ("decode_forward", first, end)):
                tracer.start_span(name, context=tctx, start_time=a).end(end_time=b)
            th.end(end_time=end)
            root.end(end_time=end)
    return send


def report(trace: Path) -> dict:
    p = mstrace("report", str(trace), "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def pct(x: list[float]) -> dict[str, float]:
    return {"p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99))}


@pytest.mark.parametrize("shape", ["vllm", "sglang", "vllm-gzip"])
def test_report_latencies_are_the_spans_own(tmp_path, shape):
    reqs = workload(40, seed=1)
    out = tmp_path / "c"
    with collector(out) as url:
        export(url, sglang_spans(reqs) if shape == "sglang" else vllm_spans(reqs), gzip=shape.endswith("gzip"))
    rep = report(out)
    lat = rep["latency"]
    assert lat["ttft_ms"]["count"] == 40 and lat["e2e_ms"]["count"] == 40
    for key, got in (("ttft_ms", [r["ttft"] * 1e3 for r in reqs]), ("e2e_ms", [r["e2e"] * 1e3 for r in reqs])):
        for q, want in pct(got).items():
            assert lat[key][q] == pytest.approx(want, abs=1e-3), (key, q)
    assert rep["throughput"]["input_tokens"] == sum(r["prompt"] for r in reqs)
    assert rep["throughput"]["output_tokens"] == sum(r["completion"] for r in reqs)
    from tracing.reader import read_table

    assert read_table(out, "spans").num_rows == (40 * 4 if shape == "sglang" else 40)  # every span as received: root, thread, two stages


def test_diff_of_two_collections_pairs_requests_by_id(tmp_path):
    a_reqs = workload(40, seed=2)
    b_reqs = [{**r, "ttft": r["ttft"] * 0.5, "e2e": r["e2e"] - r["ttft"] * 0.5} for r in a_reqs]
    for name, reqs in (("a", a_reqs), ("b", list(reversed(b_reqs)))):  # B's spans arrive in another order
        with collector(tmp_path / name) as url:
            export(url, vllm_spans(reqs))
    p = mstrace("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["bootstrap"]["resampling"]["requests"]["paired"] is True
    ttft = d["delta"]["latency"]["ttft_ms"]["p50"]  # B halved every request's TTFT
    want = float(np.percentile([r["ttft"] * 1e3 for r in b_reqs], 50) - np.percentile([r["ttft"] * 1e3 for r in a_reqs], 50))
    assert ttft["delta"] == pytest.approx(want, abs=1e-3) and ttft["ci_high"] < 0 and ttft["significant"]


def test_a_body_that_is_not_a_trace_export_is_a_400_and_stores_nothing(tmp_path):
    out = tmp_path / "c"
    with collector(out) as url:
        for body, ctype in ((b"\xff\x00garbage", "application/x-protobuf"), (b"{\"x\": 1}", "application/json"),
                            (b"not json", "application/json")):
            req = urllib.request.Request(url, data=body, headers={"Content-Type": ctype}, method="POST")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 400
            assert len(e.value.read().decode().strip().splitlines()) == 1
    from tracing.reader import read_table

    assert read_table(out, "spans").num_rows == 0 and read_table(out, "requests").num_rows == 0


def test_a_span_whose_values_the_trace_cannot_hold_is_a_400_and_later_spans_are_kept(tmp_path):
    """A time past int64, a token count past int32 or a latency that is no number: that body's
    400, one line, and the spans sent after it are still committed (such a row used to fail
    the writer's flush, which kept it and failed again every second, storing nothing more)."""
    def body(start: str, attrs: list[dict]) -> bytes:
        span = {"traceId": "0" * 31 + "1", "spanId": "0" * 15 + "1", "name": "llm_request",
                "startTimeUnixNano": start, "endTimeUnixNano": "1700000000500000000", "attributes": attrs}
        return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()

    ok_attrs = [{"key": "gen_ai.request.id", "value": {"stringValue": "r1"}},
                {"key": "gen_ai.latency.time_to_first_token", "value": {"doubleValue": 0.1}},
                {"key": "gen_ai.latency.e2e", "value": {"doubleValue": 0.5}},
                {"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": "12"}},
                {"key": "gen_ai.usage.completion_tokens", "value": {"intValue": "3"}}]
    bad = [body("18446744073709551615", ok_attrs),
           body("1700000000000000000", [*ok_attrs[:4], {"key": "gen_ai.usage.completion_tokens",
                                                        "value": {"intValue": "3000000000"}}]),
           body("1700000000000000000", [*ok_attrs[:2], {"key": "gen_ai.latency.e2e", "value": {"stringValue": "x"}},
                                        *ok_attrs[3:]])]
    out = tmp_path / "c"
    with collector(out) as url:
        for b in bad:
            req = urllib.request.Request(url, data=b, headers={"Content-Type": "application/json"}, method="POST")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 400 and len(e.value.read().decode().strip().splitlines()) == 1
        req = urllib.request.Request(url, data=body("1700000000000000000", ok_attrs),
                                     headers={"Content-Type": "application/json"}, method="POST")
        assert urllib.request.urlopen(req, timeout=10).status == 200
    from tracing.reader import read_table

    assert read_table(out, "spans").num_rows == 1 and read_table(out, "requests")["request_id"].to_pylist() == ["r1"]


def test_a_chunked_body_without_a_length_is_read_whole(tmp_path):
    """An exporter that streams its body sends it chunked, with no Content-Length: its spans are
    stored (it was read as an empty export, answered 200 and lost), the connection serves the
    next request, and a chunked body cut short or of a bad chunk size is a 400."""
    import http.client
    from urllib.parse import urlsplit

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    reqs = workload(6, seed=3)
    vllm_spans(reqs)(provider.get_tracer("engine"))
    body = encode_spans(mem.get_finished_spans()).SerializeToString()
    out = tmp_path / "c"
    with collector(out) as url:
        u = urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        pieces = [body[i:i + 100] for i in range(0, len(body), 100)]
        for _ in range(2):  # twice on one connection: the first body was read to its end
            conn.request("POST", u.path, body=iter(pieces), encode_chunked=True,
                         headers={"Content-Type": "application/x-protobuf"})
            r = conn.getresponse()
            assert r.status == 200, r.read()
            r.read()
        conn.close()
        for raw in (b"zz\r\nabc\r\n0\r\n\r\n", b"10\r\nabc"):
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
            conn.putrequest("POST", u.path)
            conn.putheader("Transfer-Encoding", "chunked")
            conn.putheader("Content-Type", "application/x-protobuf")
            conn.endheaders()
            conn.send(raw)
            if raw.endswith(b"abc"):
                conn.sock.shutdown(1)  # the client's side ends: the body is cut short
            r = conn.getresponse()
            assert r.status == 400 and len(r.read().decode().strip().splitlines()) == 1
            conn.close()
    from tracing.reader import read_table

    ids = read_table(out, "requests")["request_id"].to_pylist()
    assert sorted(ids) == sorted(2 * [r["rid"] for r in reqs])


def test_a_collected_trace_is_replayed_to_another_collector(tmp_path):
    """`export --otlp` of a collected trace sends its spans on, times unchanged (the clock
    anchor the collector writes is the one `export` reads: spans carry the wall clock)."""
    reqs = workload(5, seed=4)
    with collector(tmp_path / "a") as url:
        export(url, vllm_spans(reqs))
    with collector(tmp_path / "b") as url:
        p = mstrace("export", str(tmp_path / "a"), "--otlp", url)
        assert p.returncode == 0, p.stderr
    from tracing.reader import read_table

    cols = ["request_id", "arrival_ns", "first_token_ns", "finish_ns"]
    a, b = (read_table(tmp_path / n, "requests").select(cols).sort_by("request_id") for n in "ab")
    assert a.num_rows == 5 and a.equals(b)
