"""`mstrace serve` as a user starts it: a separate process on a free loopback port."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from http.client import HTTPConnection, HTTPResponse
from pathlib import Path
from typing import Any

from tests.cli import REPO


class Served:
    def __init__(self, out: Path, *flags: str, start_timeout: float = 120) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "viewer.cli", "serve", "--model", "tiny", "--port", "0", "--out", str(out),
             *flags],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + start_timeout
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if (m := re.search(r"on http://127\.0\.0\.1:(\d+)", line)) or not line:
                break
        if not m:
            self.proc.kill()
            raise AssertionError(f"serve did not start: {line!r} {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.port = int(m.group(1))
        self.base = f"http://127.0.0.1:{self.port}/v1"

    def conn(self, timeout: float = 60) -> HTTPConnection:
        return HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def post(self, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None,
             ) -> tuple[int, dict[str, Any]]:
        c = self.conn()
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        c.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        raw = r.read()
        c.close()
        return r.status, json.loads(raw) if raw else {}

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        c = self.conn()
        c.request("GET", path)
        r = c.getresponse()
        out = r.status, json.loads(r.read())
        c.close()
        return out

    def stream(self, body: dict[str, Any]) -> tuple[HTTPConnection, HTTPResponse]:
        c = self.conn()
        c.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                  {"Content-Type": "application/json"})
        return c, c.getresponse()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> tuple[int, str, str]:
        self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


def sse_events(resp: HTTPResponse) -> list[dict[str, Any] | str]:
    """Every `data:` payload of an SSE body, parsed ("[DONE]" stays a string)."""
    out: list[dict[str, Any] | str] = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
