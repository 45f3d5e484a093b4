"""`mstrace collect --otlp-port 4318 --out TRACE`: an OTLP/HTTP trace receiver that stores
vLLM's and SGLang's request spans as an mstrace trace.

POST /v1/traces with an ExportTraceServiceRequest (application/x-protobuf, or
application/json) -> 200 and an empty ExportTraceServiceResponse; a body that is not one ->
400 with one line, nothing stored. Every span goes to `spans` as received; a request's span
(otlp_spans.py) also becomes a `requests` row, so `report`'s latency table and `diff`'s
paired comparison read it. Rows are committed by the trace writer's flush every second and
on Ctrl-C, which ends the collection with a complete end record.
"""

from __future__ import annotations

import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow as pa

from importers.otlp_spans import OtlpError, decode, request_row, span_row
from probes.clock import clock_record
from tracing.run_status import end_record, first_line

MAX_BODY = 64 << 20


class Collector:
    def __init__(self, out: Path, host: str, port: int) -> None:
        from tracing.writer import TraceWriter

        self.out = out
        self.writer = TraceWriter(out)
        self._spans = self.writer.buffer("spans")
        self._requests = self.writer.buffer("requests")
        self._lock = threading.Lock()  # handler threads append to one buffer each
        self.received = self.requests = self.rejected = 0
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        now = time.time_ns()
        self.meta: dict[str, Any] = {
            "config": {"mode": "collected"},
            "model": {"name": None},
            "workload": {"source": "otlp", "requests": 0},
            # spans carry the wall clock: the trace's clock is it (no monotonic anchor to apply)
            "clock": clock_record((now, now), "CLOCK_REALTIME"),
            "import": {"format": "otlp", "endpoint": f"http://{host}:{port}/v1/traces"},
        }
        self.writer.write_meta(self.meta)
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.server.daemon_threads = True

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def take(self, body: bytes, content_type: str) -> int:
        spans = decode(body, content_type)  # raises OtlpError before anything is stored
        try:
            rows = [(span_row(s), request_row(s)) for s in spans]
            # converted as the writer will convert them: a value its columns cannot hold (a
            # time past int64, a token count past int32) is this body's 400, not a flush
            # that fails, keeps its rows and fails again every second after
            for name, got in (("spans", [r for r, _ in rows]), ("requests", [q for _, q in rows if q is not None])):
                pa.array(got, type=pa.struct(list(self.writer.schemas[name])))
        except (ValueError, TypeError, OverflowError, pa.ArrowException) as e:
            raise OtlpError(f"a span this trace cannot hold: {first_line(e)[:200]}") from None
        with self._lock:
            for sr, rr in rows:
                self._spans.append(sr)
                if rr is not None:
                    self._requests.append(rr)
                    self.requests += 1
            self.received += len(rows)
            for s in spans:
                self.first_ns = s.start_ns if self.first_ns is None else min(self.first_ns, s.start_ns)
                self.last_ns = s.end_ns if self.last_ns is None else max(self.last_ns, s.end_ns)
        return len(rows)

    def serve(self) -> None:
        """Until Ctrl-C (KeyboardInterrupt) or `stop()`; then the last commit and the end record."""
        try:
            self.server.serve_forever(poll_interval=0.2)
        finally:
            self.server.server_close()
            self.meta["workload"]["requests"] = self.requests
            self.meta["run"] = end_record("complete", "", self.requests, self.first_ns, self.last_ns, 0)
            self.writer.close(self.meta)

    def stop(self) -> None:
        self.server.shutdown()


def _decoded(body: bytes, encoding: str | None) -> bytes:
    """The body as sent: OTLP/HTTP exporters may gzip it (the OpenTelemetry Collector's
    otlphttp exporter does by default); inflated to at most MAX_BODY."""
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc != "gzip":
        raise OtlpError(f"Content-Encoding {encoding!r}: this receiver takes gzip or none")
    d = zlib.decompressobj(wbits=31)  # the gzip wrapper
    try:
        out = d.decompress(body, MAX_BODY + 1)
    except zlib.error as e:
        raise OtlpError(f"a gzip body that does not inflate: {e}") from None
    if len(out) > MAX_BODY or d.unconsumed_tail:
        raise OtlpError("a gzip body past 64 MiB inflated")
    return out


def _read_chunked(f: Any) -> bytes:
    """A chunked transfer-coded body (RFC 9112 7.1), at most MAX_BODY; its trailers skipped."""
    out = bytearray()
    while True:
        line = f.readline(1024)
        try:
            size = int(line.split(b";")[0].strip(), 16)
        except ValueError:
            raise OtlpError("a chunked body whose chunk size is not hexadecimal") from None
        if size < 0 or len(out) + size > MAX_BODY:
            raise OtlpError("a chunked body past 64 MiB")
        if size == 0:
            break
        chunk = f.read(size)
        if len(chunk) < size or f.read(2) != b"\r\n":
            raise OtlpError("a chunked body cut short")
        out += chunk
    while (line := f.readline(1024)) not in (b"\r\n", b"\n", b""):
        pass  # trailer fields: none of them changes the spans
    return bytes(out)


def _handler(c: Collector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/v1/traces":
                return self._reply(404, b"only /v1/traces (OTLP/HTTP traces) is served here\n", "text/plain")
            ctype = self.headers.get("Content-Type") or "application/x-protobuf"
            try:
                body = self._body()
            except OtlpError as e:
                self.close_connection = True  # the rest of a body not read would be taken for a request
                return self._reply(400, f"{e}\n".encode(), "text/plain")
            try:
                c.take(_decoded(body, self.headers.get("Content-Encoding")), ctype)
            except OtlpError as e:
                c.rejected += 1
                return self._reply(400, f"{e}\n".encode(), "text/plain")
            # an empty ExportTraceServiceResponse: no bytes in protobuf, {} in JSON
            self._reply(200, b"{}" if "json" in ctype else b"", "application/json" if "json" in ctype
                        else "application/x-protobuf")

        def _body(self) -> bytes:
            """The request's body, by its Content-Length or chunked (an exporter that streams
            its body sends no length: read as empty, its spans were answered 200 and lost)."""
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                return _read_chunked(self.rfile)
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = -1
            if not 0 <= n <= MAX_BODY:
                raise OtlpError("a body of 0 to 64 MiB with its Content-Length")
            return self.rfile.read(n)

        def _reply(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
            return  # one line per export would drown the terminal

    return Handler
