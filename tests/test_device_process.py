"""The CPU device in its own process (--cpu-device process): the same tokens as the
in-process device in every mode, honest device rows in the trace, and a device that
dies fails the run at once instead of hanging it. Also: sampled tokens depend only on
the request and position, never on preemption, mode or device."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from scheduler.config import ConfigError, EngineConfig
from scheduler.core.request import SamplingParams
from scheduler.engine import Engine
from scheduler.harness.workload import SyntheticSpec, WorkloadItem, synthetic_workload
from tests.support.cli import mstrace
from tests.support.engines import fragmenting_workload, run_engine
from tests.support.exact import F32
from tracing.reader import read_table


def outputs(eng: Engine) -> dict[str, list[int]]:
    return {r.request_id: list(r.output_ids) for r in eng.rm.finished}


# The wait limits out of reach: a loaded machine's pause between rounds (a decode that
# "waited" 0.5 s) must not change the schedule, so whether the tight pool preempts.
NO_WAIT_LIMITS = {"decode_max_wait_ms": 1e9, "prefill_max_wait_ms": 1e9}


def mixed_workload() -> list[WorkloadItem]:
    """Shared prefixes, chunked prefills, a pool small enough to preempt, and seeded
    and unseeded sampling next to greedy rows."""
    items = synthetic_workload(SyntheticSpec(14, (5, 90), (4, 40), 0.5, 16, seed=3), 512, {0, 1, 2})
    out = []
    for i, it in enumerate(items):
        sp = it.params
        if i % 3 == 1:
            sp = SamplingParams(sp.max_new_tokens, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
        elif i % 3 == 2:
            sp = SamplingParams(sp.max_new_tokens, temperature=1.0, ignore_eos=True)  # seed from run seed + id
        out.append(replace(it, params=sp))
    return out



@pytest.mark.parametrize("mode", ["serial", "overlap"])
def test_same_tokens_as_the_in_process_device(mode):
    cfg = EngineConfig(cpu_device="thread", model="tiny", mode=mode, block_size=4, kv_blocks=60, prefill_chunk=32,
                       gc=False, **NO_WAIT_LIMITS, **F32)
    items = mixed_workload()
    local = run_engine(cfg, items)
    remote = run_engine(replace(cfg, cpu_device="process"), items)
    assert sum(r.num_preemptions for r in remote.rm.finished) > 0  # the pool really was too small
    # Sampled rows too: each draw is seeded by (request, position), so which rounds were
    # in flight at a preemption (timing) cannot change a token.
    assert outputs(remote) == outputs(local)
    assert len(outputs(remote)) == len(items)
    assert remote.mm.num_free == remote.mm.num_blocks


def test_sampled_tokens_do_not_depend_on_preemption_mode_or_device():
    items = mixed_workload()
    roomy = run_engine(EngineConfig(cpu_device="thread", model="tiny", mode="serial", block_size=4, kv_blocks=2000,
                                    gc=False, **F32), items)
    assert sum(r.num_preemptions for r in roomy.rm.finished) == 0
    for mode, device in (("overlap", "thread"), ("overlap", "process"), ("timeslice", "process")):
        cfg = EngineConfig(model="tiny", mode=mode, block_size=4, kv_blocks=60, prefill_chunk=32, gc=False,
                           cpu_device=device, timeslice_chunk=8, **NO_WAIT_LIMITS, **F32)
        tight = run_engine(cfg, items)
        assert sum(r.num_preemptions for r in tight.rm.finished) > 0, (mode, device)
        assert outputs(tight) == outputs(roomy), (mode, device)


def test_defragmentation_copies_run_on_the_device_process():
    cfg = EngineConfig(cpu_device="thread", model="tiny", kv_layout="contiguous", block_size=16, kv_blocks=64,
                       **F32)
    local = run_engine(cfg, fragmenting_workload())
    remote = run_engine(replace(cfg, cpu_device="process"), fragmenting_workload())
    assert any(r.request_id == "big" for r in remote.rm.finished)
    assert outputs(remote) == outputs(local)


def test_device_rows_are_on_the_host_clock_and_streams(tmp_path):
    out = tmp_path / "t"
    p = mstrace("run", "--model", "tiny", "--requests", "12", "--mode", "overlap", "--cpu-device", "process",
                "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    pr = read_table(out, "probes").to_pydict()
    steps = read_table(out, "steps").to_pydict()
    t_lo, t_hi = min(steps["ts_ns"]), max(t + d for t, d in zip(steps["ts_ns"], steps["dur_ns"], strict=True))
    dev = [(t, d, s) for t, d, b, s in zip(pr["ts_ns"], pr["dur_ns"], pr["boundary"], pr["stream"], strict=True)
           if b == "device_compute"]
    assert {s for _, _, s in dev} == {"main", "prefill"}  # decode and prefill on their own streams
    assert all(t_lo - 5e8 <= t and t + d <= t_hi + 5e8 and d > 0 for t, d, _ in dev)
    assert "stream_wait" in pr["boundary"]  # the cross-stream event waits are device-side, and recorded
    import json

    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["cpu_device"] == "process"


def test_a_dead_device_fails_the_run_at_once():
    cfg = EngineConfig(model="tiny", cpu_device="process", wait_timeout_s=30.0)
    eng = Engine(cfg)
    try:
        for i in range(4):
            eng.submit(list(range(1, 40)), SamplingParams(200, ignore_eos=True), f"r{i}")
        deadline = time.monotonic() + 60
        while not any(r.output_ids for r in eng.rm.running) and time.monotonic() < deadline:
            eng.step() or eng.wait_for_arrivals(0.01)
        assert eng.device_proc is not None
        eng.device_proc._proc.kill()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="device process"):
            for _ in range(1000):
                eng.step()
        assert time.monotonic() - t0 < 10  # not the 30 s wait timeout
    finally:
        eng.close()


def test_a_device_that_stops_reading_fails_the_send_after_the_wait_timeout():
    """A device process that stops reading its pipe (stopped here; a stuck dispatcher): once
    the pipe is full a send waits at most the hard wait timeout, then the streams fail with
    one line. It blocked for good, outside any wait the watchdog sees."""
    import os
    import signal
    import threading

    from scheduler.device.work import MAIN, RemoteOp

    eng = Engine(EngineConfig(model="tiny", cpu_device="process", wait_timeout_s=0.5))
    try:
        assert eng.device_proc is not None
        s = eng.device_proc.streams[MAIN]
        os.kill(eng.device_proc._proc.pid, signal.SIGSTOP)

        def flood() -> None:
            for i in range(400):  # ~160 KB each: far past a socket pair's buffer
                s.submit(RemoteOp("sleep", (0.0, list(range(20_000)))), f"op{i}")
                if s.error is not None:
                    return

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive() and "stopped reading its pipe" in repr(s.error)
    finally:
        if eng.device_proc is not None:  # half a message is in its pipe: it cannot go on
            eng.device_proc._proc.kill()
        eng.close()


def test_stream_answers_stay_paired_after_a_failed_send_and_a_failed_op():
    from scheduler.device.work import MAIN, RemoteOp

    eng = Engine(EngineConfig(model="tiny", cpu_device="process"))
    try:
        assert eng.device_proc is not None
        s = eng.device_proc.streams[MAIN]
        with pytest.raises(Exception, match="pickle"):
            s.submit(RemoteOp("sleep", (lambda: 1,)), "unsendable")  # never reaches the device
        assert s.record().wait(30) and s.error is None  # the next answer pairs with the right item
        s.submit(RemoteOp("bogus", ()), "bogus")
        s.submit(RemoteOp("sleep", (1,)), "after")
        assert s.record().wait(30)
        assert "unknown device op" in repr(s.error)
        assert [o.label for o in s.completed][-2:] == ["bogus", "after"]  # skipped, but answered
        assert s.state()["queue_depth"] == 0
    finally:
        eng.close()


def test_a_launch_is_one_message_each_way():
    """A launch's start record, forward and end record leave in one message, and the
    forward's answer comes back with its end record's: each message costs a pickle, a write
    and a wake-up on the other side."""
    from scheduler.device import wire

    eng = Engine(EngineConfig(model="tiny", cpu_device="process", **F32))
    dev = eng.device_proc
    assert dev is not None
    sent: list[object] = []
    got: list[object] = []
    send, recv = dev.send, dev._recv
    dev.send = lambda msg: (sent.append(msg), send(msg))[1]  # type: ignore[method-assign]
    dev._recv = lambda: (got.append(m := recv()), m)[1]  # type: ignore[method-assign]
    try:
        for i in range(3):
            eng.submit(list(range(1, 20)), SamplingParams(4, ignore_eos=True), f"r{i}")
        run_engine_until_done(eng)
    finally:
        eng.close()
    forwards = [m for m in sent if isinstance(m, wire.Items) and any(isinstance(x, wire.Op) for x in m.items)]
    assert forwards and not any(isinstance(m, wire.Op) for m in sent)  # every forward went in a batch
    assert all([type(x) for x in m.items] == [wire.Record, wire.Op, wire.Record] for m in forwards)
    answered = [m for m in got if isinstance(m, wire.Dones)]
    assert len(answered) == len(forwards)
    assert all([d.result is not None for d in m.dones] == [True, False] for m in answered)


def test_a_batch_that_fails_takes_its_items_back():
    from scheduler.device.work import MAIN, RemoteOp

    eng = Engine(EngineConfig(model="tiny", cpu_device="process"))
    try:
        assert eng.device_proc is not None
        s = eng.device_proc.streams[MAIN]
        with pytest.raises(Exception, match="pickle"), s.batched():  # sent at the end: nothing sent
            s.record()
            s.submit(RemoteOp("sleep", (lambda: 1,)), "unsendable")
        with pytest.raises(KeyError), s.batched():  # raised before the send
            s.submit(RemoteOp("sleep", (1,)), "not sent")
            raise KeyError("the launch's own failure")
        assert s.state()["queue_depth"] == 0
        with s.batched():
            s.submit(RemoteOp("sleep", (1,)), "after")
            end = s.record()
        assert end.wait(30) and s.error is None  # the answers pair with the right items
        assert [o.label for o in s.completed][-1:] == ["after"]
        assert s.state()["queue_depth"] == 0
    finally:
        eng.close()


def run_engine_until_done(eng: Engine) -> None:
    deadline = time.monotonic() + 120
    while eng.has_work() and time.monotonic() < deadline:
        eng.step() or eng.wait_for_arrivals(0.01)
    assert len(eng.rm.finished) == eng.submitted


def test_features_that_need_an_in_process_device_are_refused():
    for kw in ({"debug_kv_check": True}, {"tp": 2, "overlap_schedule": False, "split_streams": False}):
        cfg = EngineConfig(model="tiny", cpu_device="process", **kw)
        with pytest.raises(ConfigError, match="--cpu-device thread"):
            cfg.validate()
        assert replace(cfg, cpu_device="auto").resolved_cpu_device() == "thread"
    assert EngineConfig(model="tiny", inject=("deadlock",)).resolved_cpu_device() == "process"
    p = mstrace("run", "--model", "tiny", "--cpu-device", "gpu", "--out", "/tmp/never", "-q")
    assert p.returncode != 0 and "thread or process" in p.stderr and "Traceback" not in p.stderr


SEEDS = """
import os, sys, threading, time
from scheduler.device.device_process import DeviceSeed
seeds = DeviceSeed.fork(2)
a, b = (s.take() for s in seeds)
me = open("/proc/self/cmdline", "rb").read()
# forked, not started afresh: the same command line, this process's children
print([open(f"/proc/{p.pid}/cmdline", "rb").read() == me and p.is_alive() for _, p in (a, b)])
seeds = DeviceSeed.fork(2)
unused = seeds[0]._taken[1]
seeds[0].close()  # unused: its end of the pipe is its cue to exit (close joins it)
print(unused.exitcode)
threading.Thread(target=time.sleep, args=(1,)).start()
print(DeviceSeed.fork(1))  # a thread runs: no fork
print(seeds[1].take()[1].pid, a[1].pid, b[1].pid)  # left to the host's exit
os._exit(0)  # as a killed host: no atexit handler joins or terminates them
"""


def test_a_seed_is_a_fork_that_exits_with_its_host(tmp_path):
    """DeviceSeed: forked from the host (no second torch import), and gone once the host
    is, used or not, even when the host ends without a word (its pipe's end)."""
    import subprocess
    import sys
    from pathlib import Path

    p = subprocess.run([sys.executable, "-c", SEEDS], cwd=Path(__file__).parents[1], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    forked, closed, no_fork, pids = p.stdout.splitlines()
    assert forked == "[True, True]"
    assert closed == "0"
    assert no_fork == "None"
    deadline = time.monotonic() + 60  # a bound on outliving, not on speed
    left = [int(x) for x in pids.split()]
    while left and time.monotonic() < deadline:
        left = [pid for pid in left if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        time.sleep(0.05)
    assert not left, f"seeds outlived their host: {left}"
