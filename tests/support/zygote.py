"""A pre-imported interpreter that forks one child per `mstrace` command the tests run.

Why: about 200 commands of the suite are separate processes (a user runs the CLI in
one), and each spent ~2 s of CPU importing torch, numpy and pyarrow before doing
anything: a third of the suite's CPU time on two cores. The zygote imports those three
once; each command is a fork of it that runs `python -m viewer.cli` exactly as a fresh
interpreter would from there (runpy, `__main__`, normal interpreter exit with its atexit
handlers and thread joins), with its own pid, exit status, environment, cwd and output.

What a fork shares that a fresh interpreter would not, and why it is safe here:
- the three libraries' import-time state, read from the environment when they loaded:
  a command whose environment differs from the zygote's in a variable they read
  (OMP_*, MKL_*, TORCH_*, ...) runs as a plain subprocess instead (`Zygote.can_run`);
- no thread: the zygote never starts one (it polls, single-threaded), and importing the
  three starts none that a child could inherit mid-lock; OpenMP's team is made by the
  child's first parallel region, not the zygote's;
- nothing of ours: mstrace's own modules (and typer/rich, which read the terminal's
  environment at import) are imported by each child, as a fresh process does;
- the random state: each child reseeds `random` and numpy's global generator.

Protocol: JSON lines on the zygote's stdin (`run`, `kill`), answers on its stdout
(`started` with the pid, `exited` with a subprocess-style return code). It exits, and
kills what still runs, when its stdin closes (the pytest worker went away).
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PRELOAD = ("torch", "numpy", "pyarrow", "pyarrow.parquet", "pyarrow.compute")
# environment variables the preloaded libraries (and the OpenMP/BLAS runtimes they load)
# read at import: a command that sets one of them differently needs its own interpreter
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "NVIDIA",
                   "ARROW_", "PYARROW", "NUMPY", "LD_", "PYTHON", "MALLOC")
DISABLE_ENV = "MSTRACE_TEST_NO_ZYGOTE"  # =1: every command in its own interpreter


def _serve() -> dict[str, Any] | None:
    """The zygote's loop. Returns the request in a forked child (which then runs it);
    returns None in the zygote when its stdin closes."""
    children: dict[int, str] = {}  # pid -> request id
    buf = b""
    out = sys.stdout
    while True:
        ready, _, _ = select.select([0], [], [], 0.01)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                return None
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                if req["op"] == "kill":
                    for pid, rid in children.items():
                        if rid == req["id"]:
                            os.kill(pid, signal.SIGKILL)
                    continue
                pid = os.fork()
                if pid == 0:
                    return req
                children[pid] = req["id"]
                out.write(json.dumps({"id": req["id"], "started": pid}) + "\n")
                out.flush()
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rid = children.pop(pid)
            out.write(json.dumps({"id": rid, "exited": os.waitstatus_to_exitcode(status)}) + "\n")
            out.flush()


def _become(req: dict[str, Any]) -> None:
    """In the forked child: take the command's environment, cwd and output, then run the
    CLI as `python -m viewer.cli` does."""
    import random

    import numpy as np

    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for target, path in ((1, req["stdout"]), (2, req["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(fd, target)
        os.close(fd)
    # as the interpreter makes them at start-up (PYTHONUNBUFFERED: written through)
    unbuffered = bool(req["env"].get("PYTHONUNBUFFERED"))
    enc = sys.stdout.encoding
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),  # noqa: SIM115
                                  encoding=enc, write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),  # noqa: SIM115
                                  encoding=enc, errors="backslashreplace", line_buffering=True)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    random.seed()
    np.random.seed()
    import multiprocessing

    multiprocessing.current_process().authkey = os.urandom(32)  # each process its own, as at start-up
    sys.argv = [sys.argv[0], *req["argv"]]


class Zygote:
    """The client in a pytest worker: one zygote per worker process, started on first use."""

    def __init__(self, cwd: Path) -> None:
        self.env = dict(os.environ)
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.support.zygote"], cwd=cwd,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env)
        self._lock = threading.Lock()
        self._answers: dict[str, dict[str, Any]] = {}
        self._cond = threading.Condition(self._lock)
        self._next = 0
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def can_run(self, env: dict[str, str]) -> bool:
        """False where `env` differs from the zygote's in a variable its preloaded libraries
        read at import (PYTHONUNBUFFERED aside: the child sets up its own streams), or where
        the zygote died."""
        if self._proc.poll() is not None or env.get(DISABLE_ENV) == "1":
            return False
        keys = (set(self.env) | set(env)) - {"PYTHONUNBUFFERED"}
        return all(self.env.get(k) == env.get(k) for k in keys if k.startswith(IMPORT_TIME_ENV))

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cond:
                self._answers.setdefault(msg["id"], {}).update(msg)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _send(self, msg: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(msg) + "\n").encode())
        self._proc.stdin.flush()

    def start(self, argv: list[str], cwd: Path, env: dict[str, str], stdout: str, stderr: str) -> Child:
        """`python -m viewer.cli *argv` forked from the zygote, its output to the two files
        (which must exist)."""
        with self._cond:
            rid = f"{os.getpid()}-{self._next}"
            self._next += 1
            self._send({"op": "run", "id": rid, "argv": argv, "cwd": str(cwd), "env": env,
                        "stdout": stdout, "stderr": stderr})
            while "started" not in self._answers.get(rid, {}):
                if self._proc.poll() is not None:
                    raise RuntimeError(f"the test zygote died (exit {self._proc.returncode})")
                self._cond.wait(1.0)
            return Child(self, rid, self._answers[rid]["started"], [sys.executable, "-m", "viewer.cli", *argv],
                         stdout)

    def exit_code(self, rid: str, timeout: float | None) -> int | None:
        """The child's return code, waiting up to `timeout` (None: until it exits; 0: not
        at all); None if it still runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while "exited" not in self._answers.get(rid, {}):
                if self._proc.poll() is not None:
                    raise RuntimeError(f"the test zygote died (exit {self._proc.returncode})")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(1.0 if left is None else min(left, 1.0))
            return int(self._answers[rid]["exited"])

    def run(self, argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        """`subprocess.run([python, -m, viewer.cli, *argv], capture_output=True, text=True)`."""
        with tempfile.TemporaryDirectory(prefix="zygote-") as d:
            out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
            for p in (out, err):
                Path(p).touch()
            child = self.start(argv, cwd, dict(os.environ), out, err)
            try:
                code = child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                raise subprocess.TimeoutExpired(child.args, timeout, Path(out).read_text(errors="replace"),
                                                Path(err).read_text(errors="replace")) from None
            return subprocess.CompletedProcess(child.args, code, Path(out).read_bytes().decode(),
                                               Path(err).read_bytes().decode())


class Child:
    """A forked command, as much of `subprocess.Popen` as the tests use: `stdout` reads the
    output file as a pipe reads (a line, or "" once the command has ended)."""

    def __init__(self, z: Zygote, rid: str, pid: int, args: list[str], stdout: str) -> None:
        self._z, self._rid, self.pid, self.args = z, rid, pid, args
        self.returncode: int | None = None
        self.stdout = _Tail(stdout, self)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._z.exit_code(self._rid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._z.exit_code(self._rid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # the zygote reaps it: a pid it reported ended is not ours to signal
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.stdout.read(), None


class _Tail:
    """A growing output file read like the read end of a pipe."""

    def __init__(self, path: str, child: Child) -> None:
        self._f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 (closed with the test's tmp)
        self._child = child
        self._buf = ""

    def readline(self) -> str:
        while "\n" not in self._buf:
            ended = self._child.poll() is not None  # before the read: nothing is written after it
            more = self._f.read()
            self._buf += more
            if ended and not more:
                break
            if not more:
                time.sleep(0.01)
        line, sep, rest = self._buf.partition("\n")
        self._buf = rest
        return line + sep

    def read(self) -> str:
        out, self._buf = self._buf + self._f.read(), ""
        return out


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote(cwd: Path, env: dict[str, str] | None = None) -> Zygote | None:
    """This process's zygote (started on first use), or None where a command with this
    environment (default: ours) must get a fresh interpreter (see `Zygote.can_run`)."""
    global _zygote
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    with _zygote_lock:
        if _zygote is None or _zygote._proc.poll() is not None:
            _zygote = Zygote(cwd)
    return _zygote if _zygote.can_run(env or dict(os.environ)) else None


if __name__ == "__main__":
    for name in PRELOAD:
        __import__(name)
    request = _serve()
    if request is None:
        sys.exit(0)
    _become(request)
    import runpy

    runpy.run_module("viewer.cli", run_name="__main__", alter_sys=True)
