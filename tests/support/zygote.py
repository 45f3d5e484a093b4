"""A pre-imported interpreter that forks one child per `mstrace` command the tests run.

Why: about 200 commands of the suite are separate processes (a user runs the CLI in
one), and each spent ~2 s of CPU importing torch, numpy and pyarrow before doing
anything: a third of the suite's CPU time on two cores. The zygote imports those once
(and the CLI's typer, rich and pydantic: another 0.2 s a command); each command is a fork of it that runs `python -m viewer.cli` exactly as a fresh
interpreter would from there (runpy, `__main__`, normal interpreter exit with its atexit
handlers and thread joins), with its own pid, exit status, environment, cwd and output.

What a fork shares that a fresh interpreter would not, and why it is safe here:
- the preloaded libraries' import-time state, read from the environment when they loaded:
  a command whose environment differs from the zygote's in a variable they read
  (OMP_*, MKL_*, TORCH_*, ...) runs as a plain subprocess instead (`Zygote.can_run`);
- no Python thread: the zygote never starts one (it polls, single-threaded) and checks
  that the imports started none; the native threads they start (OpenBLAS's pool,
  jemalloc's background thread) are rebuilt by those libraries' fork handlers; OpenMP's
  team is made by the child's first parallel region, not the zygote's;
- nothing of ours: mstrace's own modules are imported by each child, as a fresh process
  does;
- the random state: each child reseeds `random` and numpy's global generator.

Protocol: JSON lines on the zygote's stdin (a command to run), answers on its stdout
(`started` with the pid, `exited` with a subprocess-style return code), which nothing
else writes to: the zygote's own output goes to its stderr. Signals go to the child's
pid directly. It exits, and kills what still runs, when its stdin closes (the pytest
worker went away) or its loop fails.

What a child cannot get back: its own hash seed (the children share the zygote's, so a
check of ordering across runs wants `MSTRACE_TEST_NO_ZYGOTE=1`), warnings the preloaded
libraries print once at import (printed by the zygote), and an environment in
/proc/<pid>/environ (it shows the zygote's). So a command tagged for `tagged_pids` leads a
process group of its own, which every process it starts inherits (none of mstrace's starts
a session or group), and `tagged_pids` counts that group's members as tagged.
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

from tests.support.cli import TAG, tag_group

# The numeric libraries, and what every command imports before it does anything (the CLI's
# typer, which brings rich and pydantic): 0.2 s of a short command's 0.3 s of imports here.
PRELOAD = ("torch", "numpy", "pyarrow", "pyarrow.parquet", "pyarrow.compute",
           "typer", "typer.rich_utils", "typer._adapters", "pydantic", "rich.markdown", "rich.traceback",
           "rich.columns", "rich.panel", "rich._emoji_codes")
# environment variables the preloaded libraries (and the OpenMP/BLAS runtimes they load)
# read at import: a command that sets one of them differently needs its own interpreter
# (typer reads TYPER_USE_RICH and typer.rich_utils its terminal's variables at import;
# rich and pydantic read the environment only when called)
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "NVIDIA",
                   "ARROW_", "PYARROW", "NUMPY", "LD_", "PYTHON", "MALLOC",
                   "TYPER", "_TYPER", "TERMINAL_WIDTH", "GITHUB_ACTIONS", "FORCE_COLOR", "PY_COLORS")
DISABLE_ENV = "MSTRACE_TEST_NO_ZYGOTE"  # =1: every command in its own interpreter


def _serve(answers: int) -> dict[str, Any] | None:
    """The zygote's loop, answering on fd `answers`. Returns the request in a forked child
    (which then runs it); returns None in the zygote when its stdin closes, having killed
    what still runs (as it does when the loop itself fails)."""
    children: dict[int, str] = {}  # pid -> request id
    try:
        return _loop(answers, children)
    finally:
        if children and os.getpid() == _ZYGOTE_PID:
            for pid in children:
                os.kill(pid, signal.SIGKILL)


def _answer(fd: int, msg: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _loop(answers: int, children: dict[int, str]) -> dict[str, Any] | None:
    buf = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.01)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return None
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    children.clear()  # the child's: not its to kill
                    os.close(answers)
                    if req["group"]:
                        os.setpgid(0, 0)
                    return req
                if req["group"]:  # in both, so that the group exists once "started" is answered
                    try:
                        os.setpgid(pid, pid)
                    except OSError:
                        pass  # the child made it already, or has ended
                children[pid] = req["id"]
                _answer(answers, {"id": req["id"], "started": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _answer(answers, {"id": children.pop(pid), "exited": os.waitstatus_to_exitcode(status)})


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
                                  encoding=enc, errors="backslashreplace", write_through=unbuffered,
                                  line_buffering=not unbuffered)
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
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        self.pid = os.getpid()  # a forked pytest process has no reader thread: it starts its own

    def can_run(self, env: dict[str, str]) -> bool:
        """False where `env` differs from the zygote's in a variable its preloaded libraries
        read at import (PYTHONUNBUFFERED aside: the child sets up its own streams), or where
        the zygote died."""
        if self._proc.poll() is not None or not self._reader.is_alive() or env.get(DISABLE_ENV) == "1":
            return False
        keys = (set(self.env) | set(env)) - {"PYTHONUNBUFFERED"}
        return all(self.env.get(k) == env.get(k) for k in keys if k.startswith(IMPORT_TIME_ENV))

    def _read(self) -> None:
        assert self._proc.stdout is not None
        try:
            for line in self._proc.stdout:
                msg = json.loads(line)
                with self._cond:
                    self._answers.setdefault(msg["id"], {}).update(msg)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._cond.notify_all()

    def _check_alive(self) -> None:
        if self._proc.poll() is not None or not self._reader.is_alive():
            raise RuntimeError(f"the test zygote is gone (exit {self._proc.poll()}); its children are killed with it")

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
                        "stdout": stdout, "stderr": stderr, "group": TAG in env})
            while "started" not in self._answers.get(rid, {}):
                self._check_alive()
                self._cond.wait(1.0)
            if TAG in env:
                tag_group(env[TAG], self._answers[rid]["started"])
            return Child(self, rid, self._answers[rid]["started"], [sys.executable, "-m", "viewer.cli", *argv],
                         stdout)

    def exit_code(self, rid: str, timeout: float | None) -> int | None:
        """The child's return code, waiting up to `timeout` (None: until it exits; 0: not
        at all); None if it still runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while "exited" not in self._answers.get(rid, {}):
                self._check_alive()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(1.0 if left is None else min(left, 1.0))
            return int(self._answers[rid]["exited"])

    def run(self, argv: list[str], cwd: Path, timeout: float,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`subprocess.run([python, -m, viewer.cli, *argv], capture_output=True, text=True, env=env)`."""
        with tempfile.TemporaryDirectory(prefix="zygote-") as d:
            out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
            for p in (out, err):
                Path(p).touch()
            child = self.start(argv, cwd, dict(os.environ) if env is None else env, out, err)
            try:
                code = child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                child.stdout.close()
                raise subprocess.TimeoutExpired(child.args, timeout, Path(out).read_text(errors="replace"),
                                                Path(err).read_text(errors="replace")) from None
            child.stdout.close()
            return subprocess.CompletedProcess(child.args, code, Path(out).read_text(), Path(err).read_text())


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
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended and reaped, its answer not read yet (as Popen ignores)
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        out = self.stdout.read()
        self.stdout.close()
        return out, None


class _Tail:
    """A growing output file read like the read end of a pipe."""

    def __init__(self, path: str, child: Child) -> None:
        self._f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 (closed by the owner's communicate)
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

    def close(self) -> None:
        self._f.close()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote(cwd: Path, env: dict[str, str] | None = None) -> Zygote | None:
    """This process's zygote (started on first use), or None where a command with this
    environment (default: ours) must get a fresh interpreter (see `Zygote.can_run`)."""
    global _zygote
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    with _zygote_lock:
        if _zygote is None or _zygote._proc.poll() is not None or _zygote.pid != os.getpid():
            _zygote = Zygote(cwd)
    return _zygote if _zygote.can_run(env or dict(os.environ)) else None


_ZYGOTE_PID = os.getpid()

if __name__ == "__main__":
    answers_fd = os.dup(1)
    os.dup2(2, 1)  # anything the zygote itself prints goes to stderr, not into the protocol
    for name in PRELOAD:
        __import__(name)
    # A Python thread would be forked mid-lock. The native ones the imports start (OpenBLAS's
    # pool, jemalloc's background thread in pyarrow) have fork handlers that rebuild them.
    if threading.active_count() != 1:
        sys.exit("test zygote: a preloaded library started a Python thread; commands run as subprocesses")
    request = _serve(answers_fd)
    if request is None:
        sys.exit(0)
    _become(request)
    import runpy

    runpy.run_module("viewer.cli", run_name="__main__", alter_sys=True)
