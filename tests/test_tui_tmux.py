"""The TUI in a real terminal: tmux runs it, `capture-pane` reads what it shows.

Every wait here polls for what the screen must come to show, with a generous bound,
so a slow machine only makes the test slower."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cli import REPO
from tests.support.serve_proc import Served
from tracing.reader import Trace

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]
BOUND_S = 90.0


class Pane:
    def __init__(self, command: list[str], size: tuple[int, int] = (160, 48)) -> None:
        self.name = f"mstrace-{uuid.uuid4().hex[:8]}"
        line = f"cd {shlex.quote(str(REPO))} && {shlex.join(command)}; echo EXITED $?; sleep 600"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", str(size[0]), "-y", str(size[1]), line],
                       check=True)
        # without a client attached, a window can still take tmux's default size
        subprocess.run(["tmux", "resize-window", "-t", self.name, "-x", str(size[0]), "-y", str(size[1])],
                       capture_output=True)

    def text(self, history: bool = False) -> str:
        cmd = ["tmux", "capture-pane", "-p", "-t", self.name, *(["-S", "-"] if history else [])]
        return subprocess.run(cmd, capture_output=True, text=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def wait_for(self, ok: Callable[[str], bool], what: str) -> str:
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            t = self.text()
            if ok(t):
                return t
            time.sleep(0.2)
        raise AssertionError(f"the pane never showed {what}; it shows:\n{self.text()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def _round(screen: str) -> int:
    """The header's round number; 0 while it shows "-" (attached before the first round: a
    pane can show the ranks' rows first, as one of ci46's did)."""
    head = next(line for line in screen.splitlines() if " round " in line)
    word = head.split(" round ", 1)[1].split()[0]
    return int(word) if word.isdigit() else 0


def _run_process_alive(out: Path) -> bool:
    """Whether `run --live`'s child (its command line has the trace and no --live) runs."""
    for p in Path("/proc").iterdir():
        try:
            args = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(out).encode() in args and b"--live" not in args and b"run" in args:
            return True
    return False


def _mstrace(*args: str) -> list[str]:
    return [sys.executable, "-m", "viewer.cli", *args]


def test_run_live_shows_lanes_and_the_cost_table_updating(tmp_path: Path) -> None:
    out = tmp_path / "live"
    pane = Pane(_mstrace("run", "--model", "tiny", "--requests", "6000", "--rate", "60", "--live", "--out", str(out)))
    try:
        first = pane.wait_for(lambda t: "lanes" in t and "sync cost, last" in t and "r0 main" in t and " round " in t,
                              "the lanes and the cost table")
        panels = ("device_compute", "latency, ms", "KV pool")
        # one capture may catch a repaint half done: wait for a screen with everything on it
        pane.wait_for(lambda t: " round " in t and _round(t) > _round(first) and all(x in t for x in panels),
                      "the round number moving on, with every panel")
        pane.keys("C-c")  # leaves the view and stops the run, which prints its report
        t0 = time.monotonic()
        done = pane.wait_for(lambda t: "EXITED" in t, "the command's end")
        print(f"Ctrl-C to the shell's prompt: {time.monotonic() - t0:.2f} s (polled every 0.2 s)")
        assert "EXITED 130" in done  # stopped as Ctrl-C stops a run
        screen = pane.text(history=True)
        assert "sync-cost table" in screen and "throughput and latency" in screen  # the report of what ran
        st = Trace.open(out).status
        assert st.state == "interrupted" and 0 < st.submitted < 6000  # stopped, not run to its end
    finally:
        pane.close()


def test_a_deadlock_shows_its_wait_cycle_while_the_run_still_waits(tmp_path: Path) -> None:
    out = tmp_path / "dl"
    # --on-stall continue: the stuck wait goes on (up to 10x the timeout) after the watchdog's report;
    # 2 s leaves 18 s to see the banner and the run still alive (1 s left 9 on a loaded host)
    pane = Pane(_mstrace("run", "--model", "tiny", "--mode", "overlap", "--inject", "deadlock", "--wait-timeout", "2",
                         "--on-stall", "continue", "--live", "--out", str(out)))
    try:
        shown = pane.wait_for(lambda t: "STALL at round" in t, "the stall banner")
        assert "wait cycle:" in " ".join(shown.split()), shown  # the banner may wrap
        assert _run_process_alive(out)  # the banner came while the run was still stuck, not after it
        pane.keys("q")
        pane.wait_for(lambda t: "EXITED" in t, "the command's end")
    finally:
        pane.close()


def test_top_attaches_to_a_running_server(tmp_path: Path) -> None:
    srv = Served(tmp_path / "srv")
    pane = Pane(_mstrace("top", str(srv.out), "--window", "5"))
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            status, _ = srv.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 16,
                                                     "ignore_eos": True})
            assert status == 200

    try:

        t = threading.Thread(target=load, daemon=True)
        t.start()
        first = pane.wait_for(lambda t: "r0 main" in t and " round " in t and _round(t) > 0, "the server's rounds")
        pane.wait_for(lambda t: " round " in t and _round(t) > _round(first), "the rounds moving on")
        assert "live" in pane.text()
        stop.set()
        t.join(60)
        pane.keys("q")
        pane.wait_for(lambda t: "EXITED 0" in t, "top's clean exit")
    finally:
        pane.close()
        rc, _, err = srv.stop()
        assert rc == 0, err
