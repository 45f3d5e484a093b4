"""`mstrace serve` as a user starts it: a separate process on a free loopback port."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.client import HTTPConnection, HTTPResponse
from pathlib import Path
from typing import Any

from tests.support.cli import REPO
from tests.support.zygote import Child, zygote


class Served:
    def __init__(self, out: Path, *flags: str, start_timeout: float = 120) -> None:
        self.out = out
        # stderr to a file: a pipe nobody reads while the server runs fills up, and the
        # server's next log line then blocks its event loop
        out.parent.mkdir(parents=True, exist_ok=True)
        self._err_path = out.parent / f"{out.name}.serve-stderr.txt"
        self._err = self._err_path.open("w")
        argv = ["serve", "--model", "tiny", "--port", "0", "--out", str(out), *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        z = zygote(REPO, env)  # a fork of a pre-imported interpreter (tests/support/zygote.py)
        if z is not None:
            stdout = out.parent / f"{out.name}.serve-stdout.txt"
            stdout.touch()
            self.proc: subprocess.Popen[str] | Child = z.start(argv, REPO, env, str(stdout), str(self._err_path))
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "viewer.cli", *argv], cwd=REPO,
                                         stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + start_timeout
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if (m := re.search(r"on http://127\.0\.0\.1:(\d+)", line)) or not line:
                break
        if not m:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"serve did not start: {line!r} {self._err_path.read_text()}")
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
        out, _ = self.proc.communicate(timeout=timeout)
        self._err.close()
        return self.proc.returncode, out, self._err_path.read_text()


@contextmanager
def serving(out: Path, *flags: str) -> Iterator[Served]:
    """A server for the tests that share it: it must stop cleanly (exit 0) when they are done."""
    s = Served(out, *flags)
    yield s
    rc, _, err = s.stop()
    assert rc == 0, err


def sse_events(resp: HTTPResponse) -> list[dict[str, Any] | str]:
    """Every `data:` payload of an SSE body, parsed ("[DONE]" stays a string)."""
    out: list[dict[str, Any] | str] = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
