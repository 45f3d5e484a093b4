"""`mstrace run --model tiny` traces made once per set of flags for the whole session.

With xdist every worker builds its own session fixtures; these traces live in a folder all
the workers of one session share, and the first worker to ask for one makes it under a file
lock while the others wait for it, then read the same trace. A trace made here is read-only
to every test: a test that writes into a trace (corrupts it, compacts it) makes its own or
works on a copy."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cli import mstrace

# The injected wait cycle (overlap's two streams), caught past a 2 s wait timeout: exit 3.
DEADLOCK = ("--mode", "overlap", "--inject", "deadlock", "--wait-timeout", "2")


@dataclass(slots=True, frozen=True)
class TinyRun:
    out: Path  # the trace
    stdout: str
    stderr: str


def session_root(factory: pytest.TempPathFactory) -> Path:
    """A folder shared by this session's workers (each has its own basetemp below the
    session's), or the basetemp itself without xdist."""
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tiny-runs"
    root.mkdir(exist_ok=True)
    return root


class TinyRuns:
    """tiny_runs(*flags) -> the TinyRun of `mstrace run --model tiny *flags --out DIR`, made
    at most once in the session for those flags (in that order)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, *flags: str, exit_code: int = 0, timeout: float = 600) -> TinyRun:
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", " ".join(flags)).strip("-")[:60]
        key = f"{slug}-{hashlib.sha1(repr((flags, exit_code)).encode()).hexdigest()[:8]}"
        here = self.root / key
        out, done = here / key, here / "done.json"  # the trace's folder is named after its flags
        here.mkdir(exist_ok=True)
        with (self.root / f"{key}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not done.exists():
                shutil.rmtree(out, ignore_errors=True)  # a failed attempt's leftovers
                p = mstrace("run", "--model", "tiny", *flags, "--out", str(out), timeout=timeout)
                assert p.returncode == exit_code, p.stderr
                done.write_text(json.dumps({"flags": flags, "stdout": p.stdout, "stderr": p.stderr}))
        got = json.loads(done.read_text())
        return TinyRun(out, got["stdout"], got["stderr"])
