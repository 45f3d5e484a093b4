"""`mstrace run --tp N --pp M` end to end: real gloo ranks spawned by the CLI, against transformers.

The slow tests run the CLI as a user does (a subprocess, which spawns its own worker ranks) and
check, after every run including the failed one, that no worker survives: each run carries a
unique environment tag that its workers inherit, and /proc is scanned for it (a worker orphaned
by a dead rank 0 is re-parented, so "children of the test" would miss it).  The fast tests cover
the pieces: the batch wire format, per-rank trace parts and clock shift, the analyses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, cast

import pyarrow as pa
import pytest
import torch

from probes import boundaries as B
from scheduler.config import ConfigError, EngineConfig
from scheduler.model.forward_batch import SeqChunk
from scheduler.parallel.batch_wire import RUN, WireBatch, decode, encode
from scheduler.parallel.launch import STOP_GRACE_S
from tests.support.cli import REPO, TAG, mstrace, tagged_pids
from tests.support.oracle import teacher_forced_mismatches
from tracing.reader import read_meta, read_table
from tracing.schema import COLLECTIVES, PROBES, STEPS
from tracing.writer import TraceWriter
from viewer.analysis.collectives import last_seqs, never_joined, straggler_view
from viewer.analysis.cost import cost_table

# A hang detector, not a speed bound: a TP2 run took 29 s on a loaded CI host (ci48) and over 40 s
# on a slower one (ci50); a hung run still fails, at this bound.
RUN_TIMEOUT_S = 180.0


# ----------------------------------------------------------------------------- helpers


def _run(*args: str, tag: str) -> subprocess.CompletedProcess[str]:
    return mstrace("run", *args, env={**os.environ, TAG: tag}, timeout=RUN_TIMEOUT_S, check_views=False)


def _assert_no_survivors(tag: str) -> None:
    deadline = time.monotonic() + 2  # a just-killed child may take a moment to be reaped
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"worker processes survived the run: {left}"


def _workload(model_dir: Path, path: Path) -> list[dict[str, object]]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    lines = [{"id": f"r{i}", "input_ids": torch.randint(10, vocab, (n,), generator=g).tolist(),
              "max_new_tokens": 10 + i, "ignore_eos": True} for i, n in enumerate([3, 17, 40, 70, 33])]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    return lines


def _check_greedy(model_dir: Path, out: Path, lines: list[dict[str, object]]) -> None:
    req = read_table(out, "requests").to_pydict()
    assert sorted(req["request_id"]) == [f"r{i}" for i in range(len(lines))]
    checked = 0
    for i, rid in enumerate(req["request_id"]):
        prompt, output = req["input_ids"][i], req["output_ids"][i]
        assert len(output) == lines[int(rid[1:])]["max_new_tokens"]
        bad, ties = teacher_forced_mismatches(model_dir, prompt, output)
        assert bad == 0, f"{rid}: {bad} greedy tokens differ from transformers"
        checked += len(output) - ties
    assert checked >= 0.95 * sum(len(o) for o in req["output_ids"])


# ckpt (tests/conftest.py), not a preset: GQA 6 / 2 (one KV head per TP rank), tied embeddings,
# 3 layers (PP2: 2 + 1).
# float32: these runs are compared with transformers in float32 (auto may pick bfloat16 on a GPU or an AMX CPU)
ARGS = ("--block-size", "4", "--prefill-chunk", "16", "--kv-blocks", "200", "--dtype", "float32", "-q")


# ----------------------------------------------------------------------------- slow: real ranks


@pytest.mark.slow
def test_tp2_run_matches_transformers_and_traces_every_rank(ckpt: Path, tmp_path: Path) -> None:
    lines = _workload(ckpt, tmp_path / "w.jsonl")
    out, tag = tmp_path / "trace", uuid.uuid4().hex
    p = _run("--model", str(ckpt), "--workload", str(tmp_path / "w.jsonl"), "--out", str(out),
             "--tp", "2", "--comm-overlap", "on", *ARGS, tag=tag)
    _assert_no_survivors(tag)
    assert p.returncode == 0, p.stderr
    _check_greedy(ckpt, out, lines)

    meta = read_meta(out)
    assert meta["parallel"]["tp"] == 2 and meta["parallel"]["world"] == 2
    # rank 1 is a subprocess.Popen child (not multiprocessing's): its CPU is in the run's
    cpu = meta["run"]["cpu"]
    assert cpu["children"] >= 1 and cpu["children_ns"] > 0 and cpu["total_ns"] == cpu["process_ns"] + cpu["children_ns"]
    assert meta["ranks"]["1"]["same_clock"] and meta["ranks"]["1"]["offset_ns"] == 0
    assert abs(meta["ranks"]["1"]["measured_ns"]) <= meta["ranks"]["1"]["rtt_ns"]
    assert any(f.name.startswith("part-r1-") for f in (out / "probes").iterdir())
    probes = read_table(out, "probes").to_pydict()
    ar = [(r, s) for b, r, s in zip(probes["boundary"], probes["rank"], probes["stream"], strict=True)
          if b == B.ALL_REDUCE]
    assert {r for r, _ in ar} == {0, 1} and {s for _, s in ar} == {"comm"}
    colls = read_table(out, "collectives").to_pydict()
    for r in (0, 1):  # numbered 0, 1, 2, ... on each rank, all completed and waited
        seqs = [s for s, rk in zip(colls["seq"], colls["rank"], strict=True) if rk == r]
        assert seqs == list(range(len(seqs))) and seqs
    assert min(colls["end_ns"]) > 0 and min(colls["dur_wait_ns"]) >= 0
    assert any(colls["overlapped"])  # --comm-overlap on: the split-batch schedule ran

    rep = json.loads(mstrace("report", str(out), "--json").stdout)
    share = {b["boundary"]: b for b in rep["boundaries"]}
    assert share["all_reduce"]["device_share"] > 0 and share["batch_broadcast"]["count"] > 0
    assert set(rep["per_rank"]) == {"0", "1"}
    r1 = {b["boundary"]: b for b in rep["per_rank"]["1"]["boundaries"]}
    assert r1["all_reduce"]["count"] == len([s for s in colls["rank"] if s == 1])
    assert 0 < r1["device_compute"]["device_share"] < 1 and r1["all_reduce"]["device_share"] > 0
    # rank 1's exposed rows fit inside rank 0's cycles: the remainder is not negative
    assert r1["scheduler_barrier"]["device_share"] >= 0
    # rank 1 has no scheduling thread: no host view in its JSON or its table, and rank 0's table
    # (the top one) is not printed a second time
    assert rep["per_rank"]["1"]["host_share_sum"] is None and r1["device_compute"]["host_share"] is None
    text = mstrace("report", str(out)).stdout
    rank1 = text[text.index("rank 1 (against"):text.index("all_reduce per rank")]
    assert "rank 0 (against" not in text and "host" not in rank1
    said = next(ln for ln in rank1.splitlines() if ln.startswith("cycle ") and "computes" in ln)
    assert "rank 1's device computes" in said and "scheduling thread" not in said, said
    sv = rep["stragglers"]
    assert sv["collectives"] == len(colls["seq"]) // 2 and {x["rank"] for x in sv["ranks"]} == {0, 1}


@pytest.mark.slow
def test_pp2_run_matches_transformers(ckpt: Path, tmp_path: Path) -> None:
    lines = _workload(ckpt, tmp_path / "w.jsonl")
    out, tag = tmp_path / "trace", uuid.uuid4().hex
    p = _run("--model", str(ckpt), "--workload", str(tmp_path / "w.jsonl"), "--out", str(out),
             "--pp", "2", *ARGS, tag=tag)
    _assert_no_survivors(tag)
    assert p.returncode == 0, p.stderr
    _check_greedy(ckpt, out, lines)
    assert read_meta(out)["parallel"]["logits_rank"] == 1
    probes = read_table(out, "probes").to_pydict()
    bubbles = {r for b, r in zip(probes["boundary"], probes["rank"], strict=True) if b == B.PP_BUBBLE}
    assert bubbles == {0, 1}  # rank 0 waits for the tokens, rank 1 for its input
    rep = json.loads(mstrace("report", str(out), "--json").stdout)
    assert {b["boundary"] for b in rep["per_rank"]["1"]["boundaries"]} >= {B.PP_BUBBLE, B.DEVICE_COMPUTE}


@pytest.mark.slow
def test_pp2_samples_the_same_tokens_as_one_process(ckpt: Path, tmp_path: Path) -> None:
    # Draw seeds travel with the batch (token_seed of request and position): the last stage
    # samples what one process (here the default CPU device process) samples.
    lines = _workload(ckpt, tmp_path / "w.jsonl")
    for i, x in enumerate(lines):
        x.update({"temperature": 0.9, "top_p": 0.95}, **({"seed": 40 + i} if i % 2 else {}))
    (tmp_path / "w.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    outs = []
    for extra in ((), ("--pp", "2")):
        out, tag = tmp_path / f"trace{len(extra)}", uuid.uuid4().hex
        p = _run("--model", str(ckpt), "--workload", str(tmp_path / "w.jsonl"), "--out", str(out), *extra, *ARGS,
                 tag=tag)
        _assert_no_survivors(tag)
        assert p.returncode == 0, p.stderr
        req = read_table(out, "requests").to_pydict()
        outs.append(dict(zip(req["request_id"], req["output_ids"], strict=True)))
    assert outs[0] == outs[1] and len(outs[0]) == len(lines)


@pytest.mark.slow
def test_stall_rank_names_the_missing_rank_and_leaves_no_process(ckpt: Path, tmp_path: Path) -> None:
    _workload(ckpt, tmp_path / "w.jsonl")
    out, tag = tmp_path / "trace", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "viewer.cli", "run", "--model", str(ckpt), "--workload",
           str(tmp_path / "w.jsonl"), "--out", str(out), "--tp", "2", "--inject", "stall-rank",
           "--wait-timeout", "2", *ARGS]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, TAG: tag}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        seen: list[int] = []
        while not seen and proc.poll() is None and time.monotonic() - t0 < RUN_TIMEOUT_S:
            seen = tagged_pids(tag, exclude=proc.pid)  # the scan does see the workers (positive control)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended_ns = time.monotonic_ns()
    assert seen, "never saw a worker process"
    _assert_no_survivors(tag)
    assert proc.returncode == 3, err
    assert "engine stalled: all_reduce #" in err

    d = json.loads(mstrace("stalls", str(out), "--json").stdout)
    ar = [s for s in d["stalls"] if s["boundary"] == B.ALL_REDUCE]
    assert ar and ar[0]["rank"] == 0 and ar[0]["never_joined"][0]["rank"] == 1
    # The watchdog's report is stamped on this clock (CLOCK_MONOTONIC), so the time from it to the
    # exit is the teardown alone; start-up before it varies with the machine's load. A teardown
    # that waited for a clean exit from the rank that never answers would take STOP_GRACE_S or more.
    teardown_s = (ended_ns - ar[0]["ts_ns"]) / 1e9
    assert 0 < teardown_s < STOP_GRACE_S, f"the stalled run took {teardown_s:.1f} s to end after the report"
    seq = int(ar[0]["what"].split("#")[1].split()[0])
    assert ar[0]["what"] == f"all_reduce #{seq} (rank 1 never joined)"
    assert ar[0]["never_joined"][0]["last_seq"] == seq - 1  # it joined every collective before
    colls = read_table(out, "collectives").to_pydict()
    r0 = [(s, e) for s, e, r in zip(colls["seq"], colls["end_ns"], colls["rank"], strict=True) if r == 0]
    assert (seq, -1) in r0  # rank 0's own record: issued, never completed


# ----------------------------------------------------------------------------- fast

RANK_SEEDS = """
import os, socket
from scheduler.parallel.launch import PARENT_PID_ENV, free_port, stop_workers
from scheduler.parallel.worker import RankSeed
seeds = RankSeed.fork(2)
me = open("/proc/self/cmdline", "rb").read()
print([open(f"/proc/{s._seed[1].pid}/cmdline", "rb").read() == me for s in seeds])  # forked, not spawned
print(seeds[0].start({"WORLD_SIZE": "2"}).wait(60))  # no RANK: fails as the module run would
# a rank waiting for a rank 0 that never comes: stopped as a failed run stops its ranks (its
# layout must fit the world, or it fails on that at once, before or after the stop: a race)
env = {"RANK": "1", "WORLD_SIZE": "2", "MSTRACE_TP": "2", "MASTER_ADDR": "127.0.0.1",
       "MASTER_PORT": str(free_port()), PARENT_PID_ENV: str(os.getpid())}
hung = seeds[1].start(env)
print(hung.poll(), stop_workers([hung], graceful=False), hung.poll())
"""


def test_a_rank_seed_is_a_fork_that_runs_the_worker_and_stops_like_a_popen(tmp_path: Path) -> None:
    """RankSeed (scheduler/seeds.py): a rank forked from rank 0 runs `worker_main` with the
    environment spawn_workers gives it, and `stop_workers` ends it through the same calls
    as a Popen'd one."""
    p = subprocess.run([sys.executable, "-c", RANK_SEEDS], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    forked, bad, stopped = p.stdout.splitlines()
    assert forked == "[True, True]"
    assert bad == "1" and "KeyError: 'RANK'" in p.stderr
    before, codes, after = stopped.split(" ", 1)[0], *stopped.split(" ", 1)[1].rsplit(" ", 1)
    assert before == "None"  # still waiting for rank 0 when stopped
    # ended by SIGTERM: before worker_main's handler (-15) or through its flush (143); else SIGKILL
    assert codes in ("[-15]", "[143]", "[-9]") and after == codes.strip("[]")


def test_batch_wire_round_trip() -> None:
    b = WireBatch(RUN, 17, [
        SeqChunk([5, 6, 7], 0, [3, 9], False),
        SeqChunk([8], 40, [1, 2, 4], True),
        SeqChunk(list(range(20)), 16, [0, 5, 6], True),
    ], [0.0, 0.7], [1.0, 0.9], [0, 123456789012345])
    header, payload = encode(b)
    assert header.dtype == payload.dtype == torch.int64 and header.tolist()[:3] == [RUN, 17, 3]
    got = decode(header, payload)
    assert got == b
    with pytest.raises(ValueError, match="placeholder"):
        encode(WireBatch(RUN, 1, [SeqChunk([-3], 4, [0], True)], [0.0], [1.0], [0]))


def test_config_refuses_overlap_and_lone_stall_rank() -> None:
    with pytest.raises(ConfigError, match="serially"):
        EngineConfig(tp=2, mode="overlap").validate()
    EngineConfig(tp=2, mode="overlap", overlap_schedule=False, split_streams=False).validate()
    with pytest.raises(ConfigError, match="more than one rank"):
        EngineConfig(inject=("stall-rank",)).validate()
    with pytest.raises(ConfigError, match="--pp-microbatches must be 1 or 2"):
        EngineConfig(pp=2, pp_microbatches=3, overlap_schedule=False, split_streams=False).validate()


def test_worker_parts_are_named_per_rank_and_shifted(tmp_path: Path) -> None:
    w0, w1 = TraceWriter(tmp_path), TraceWriter(tmp_path, rank=1, clock_offset_ns=1000)
    w0.write_meta({})
    w0.buffer("probes").append((5000, 10, B.ALL_REDUCE, "comm", 0, 1))
    w1.buffer("probes").append((5000, 10, B.ALL_REDUCE, "comm", 1, 1))
    w1.buffer("collectives").append((1, "tp0", 0, 1, 4, False, 5000, 5000, -1, -1))
    w0.close()
    w1.close()
    names = sorted(p.name for p in (tmp_path / "probes").iterdir())
    assert len(names) == 2 and re.fullmatch(r"part-\d{6}\.parquet", names[0]) \
        and re.fullmatch(r"part-r1-\d{6}\.parquet", names[1]), names
    assert (tmp_path / "manifest.json").is_file() and (tmp_path / "manifest-r1.json").is_file()
    rows = sorted(read_table(tmp_path, "probes").to_pylist(), key=lambda r: r["rank"])
    assert [(r["ts_ns"], r["dur_ns"]) for r in rows] == [(5000, 10), (4000, 10)]  # durations unshifted
    c = read_table(tmp_path, "collectives").to_pylist()[0]
    assert (c["issue_ns"], c["end_ns"], c["dur_wait_ns"]) == (4000, -1, -1)  # -1 stays "never"


def _tables(rows: Sequence[tuple[object, ...]], steps: list[tuple[int, int]]) -> tuple[pa.Table, pa.Table]:
    probes = pa.Table.from_pylist([dict(zip(PROBES.names, r, strict=True)) for r in rows], schema=PROBES)
    st = pa.Table.from_pylist(
        [{**dict.fromkeys(STEPS.names, 0), "step": i + 1, "mode": "serial", "ts_ns": t, "dur_ns": d}
         for i, (t, d) in enumerate(steps)], schema=STEPS)
    return probes, st


def test_worker_rank_costs_against_rank_0_cycles() -> None:
    """Rank 1's comm waits are device-idle (exposed), rank 0's idle time leaves its cycles, and
    all_reduce's hidden fraction is the part of issue -> completion under compute (HTA)."""
    rows = [
        (0, 1000, B.DEVICE_COMPUTE, "main", 0, 1),
        (1000, 500, B.IDLE, "host", 0, -1),  # rank 0 had no work: not a cycle cost for anyone
        (0, 800, B.DEVICE_COMPUTE, "main", 1, 1),  # rank 1's forward ...
        (100, 200, B.ALL_REDUCE, "comm", 1, 1),  # ... blocked 200 ns in a collective ...
        (0, 50, B.BATCH_BROADCAST, "comm", 1, 1),  # ... and 50 ns receiving the batch
    ]
    probes, steps = _tables(rows, [(0, 1500)])
    colls = pa.Table.from_pylist([
        {"rank": 1, "group": "tp0", "seq": 0, "step": 1, "numel": 4, "overlapped": True,
         "issue_ns": 0, "start_ns": 0, "end_ns": 300, "dur_wait_ns": 200},
    ], schema=COLLECTIVES)
    c = cost_table(probes, steps, rank=1, collectives=colls)
    b = {x.boundary: x for x in c.boundaries}
    assert c.cycle_total_s * 1e9 == pytest.approx(1000)  # 1500 - rank 0's 500 idle
    assert b[B.DEVICE_COMPUTE].share == pytest.approx(550 / 1000)  # 800 - 200 - 50
    assert b[B.ALL_REDUCE].share == pytest.approx(200 / 1000)
    assert b[B.BATCH_BROADCAST].share == pytest.approx(50 / 1000)
    assert b[B.ALL_REDUCE].raw_ms_per_cycle * 1e6 == pytest.approx(300)  # issue -> completion
    assert b[B.ALL_REDUCE].hidden == pytest.approx(50 / 300)  # computing in [50, 100) only
    assert b["unattributed"].share == pytest.approx(200 / 1000)  # 800..1000: idle, no probe of rank 1's


def _colls(rows: list[tuple[int, int, int]]) -> pa.Table:
    """(rank, seq, issue_ns) rows of group tp0."""
    return pa.Table.from_pylist([
        {"rank": r, "group": "tp0", "seq": s, "step": 1, "numel": 1, "overlapped": False,
         "issue_ns": t, "start_ns": t, "end_ns": t + 10, "dur_wait_ns": 5} for r, s, t in rows
    ], schema=COLLECTIVES)


def test_stragglers_and_never_joined() -> None:
    c = _colls([(0, 0, 100), (1, 0, 400), (0, 1, 900), (1, 1, 600), (0, 2, 1000)])
    sv = straggler_view(c)
    assert sv is not None and sv.collectives == 2  # #2 was issued by rank 0 only
    by = {x.rank: x for x in sv.ranks}
    assert (by[1].last, by[0].last) == (1, 1)
    assert by[1].mean_ms == pytest.approx(300e-6) and by[0].max_ms == pytest.approx(300e-6)
    last = last_seqs(c)
    assert last_seqs(c.cast(c.schema.set(1, pa.field("group", pa.string())))) == last
    other = _colls([(2, 7, 50)])
    other = other.set_column(1, "group", pa.array(["tp1"]).dictionary_encode())
    two = pa.concat_tables([c, other])  # two chunks, each with its own dictionary (as two parts' reads)
    assert not two["group"].chunk(0).dictionary.equals(two["group"].chunk(1).dictionary)
    assert last_seqs(two) == {**last, ("tp1", 2): 7}
    assert never_joined(last, "tp0", 2, [1]) == {1: 1}
    assert never_joined(last, "tp0", 1, [1]) == {}
    assert never_joined(last, "tp0", 0, [1, 2]) == {2: -1}


class _FakeP2PWork:
    """Like a gloo send/recv Work: a timed-out wait fails it for good, completion is only seen
    inside wait()."""

    def __init__(self, done_after_s: float) -> None:
        self.t_done = time.monotonic() + done_after_s
        self.waits: list[float] = []
        self.failed = False

    def is_completed(self) -> bool:
        return self.failed

    def wait(self, timeout: Any = None) -> bool:
        if self.failed:
            raise RuntimeError("Application timeout caused pair closure")
        t = None if timeout is None else timeout.total_seconds()
        self.waits.append(-1.0 if t is None else t)
        left = self.t_done - time.monotonic()
        if t is not None and left > t:
            time.sleep(t)
            self.failed = True
            raise RuntimeError("Timed out waiting for recv operation to complete")
        time.sleep(max(0.0, left))
        return True


def test_p2p_wait_is_one_blocking_call_not_slices() -> None:
    """A p2p receive slower than timed_wait's 0.1 s slice still completes (gloo would fail it on
    the first timed-out slice), and a stuck one ends in WaitTimeout, not the transport's error."""
    from probes.waits import WaitRegistry, WaitTimeout, timed_wait
    from scheduler.parallel.comm import p2p_ready

    work = _FakeP2PWork(0.3)
    timed_wait(p2p_ready(cast(Any, work), 2.0), registry=WaitRegistry(), waiter="r0", what="x",
               signaller="r1", boundary=B.PP_BUBBLE, timeout_s=2.0)
    assert len(work.waits) == 1 and work.waits[0] > 1.5
    stuck = _FakeP2PWork(60)
    with pytest.raises(WaitTimeout):
        timed_wait(p2p_ready(cast(Any, stuck), 0.3), registry=WaitRegistry(), waiter="r0", what="x",
                   signaller="r1", boundary=B.PP_BUBBLE, timeout_s=0.3)


def test_a_rank_that_did_not_exit_cleanly_after_stop_makes_the_run_an_error(tmp_path):
    """After STOP a worker flushes its trace and exits 0; one that exits otherwise (its last
    flush failed, or it was stopped in it) may have left its part short. The run said
    `complete` and exit 0; now it is `error` naming the rank, and the command fails."""
    from types import SimpleNamespace

    from scheduler.config import EngineConfig
    from scheduler.harness.session import TracedSession
    from scheduler.parallel.coordinator import Coordinator

    class Exited:
        def __init__(self, code: int) -> None:
            self.returncode = code

        def poll(self) -> int:
            return self.returncode

        def wait(self, timeout: float | None = None) -> int:
            return self.returncode

    def coordinator(*codes: int) -> Any:
        return SimpleNamespace(channel=None, procs=[Exited(c) for c in codes], exit_codes=[],
                               cfg=SimpleNamespace(hard_wait_timeout_s=0.0),
                               log=SimpleNamespace(drain=lambda final: None))

    assert Coordinator.close(coordinator(0, 0), ok=True) is None
    assert Coordinator.close(coordinator(1, 0), ok=False) is None  # a failed run says why itself
    said = Coordinator.close(coordinator(0, 1, -9), ok=True)
    assert said is not None and "rank 2 exited with code 1" in said and "rank 3 was killed by signal 9" in said

    failed: list[str] = []

    def fail(msg: str, code: int = 2) -> NoReturn:
        failed.append(f"{code}: {msg}")
        raise SystemExit(code)

    out = tmp_path / "t"
    with pytest.raises(SystemExit), TracedSession(EngineConfig(), out, None, [], "test", fail) as s:
        s.on_close(lambda ok: Coordinator.close(coordinator(0, 1), ok))
        s.ended("complete")
    # (no engine ran here, so the session removes its folder: the end record is the state's)
    assert s.state == "error" and "rank 2 exited with code 1" in s.detail
    assert len(failed) == 1 and failed[0].startswith("4: the run failed: ") and s.detail in failed[0]  # exit 4


def test_torchrun_starts_every_rank_from_one_command_line_with_its_config_file(tmp_path):
    """Under torchrun (the tool a multi-node user runs) every rank gets rank 0's command line;
    the workers read the group sizes and the device from its --config file too (they read
    only the flags: with `tp = 2` in the file they raised tp 1 x pp 1 != world 2)."""
    conf = tmp_path / "c.toml"
    conf.write_text('tp = 2\ndevice = "cpu"\nrequests = 4\n')  # a run option too (workers refused it)
    out = tmp_path / "t"
    p = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
                        "-m", "viewer.commands.torchrun", "run", "--model", "tiny", "--config", str(conf),
                        "--out", str(out), "-q"],
                       cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-2000:]
    meta = read_meta(out)
    assert meta["run"]["status"] == "complete" and meta["parallel"]["launcher"] == "torchrun"
    assert set(read_table(out, "probes")["rank"].to_pylist()) == {0, 1}


def test_a_worker_whose_sigterm_waits_for_a_point_to_point_receive_is_given_that_long():
    """A PP worker blocked in a receive (gloo cannot wait for one in slices) takes SIGTERM only
    when the wait returns: rank 0 allows the hard wait timeout before it kills, so the
    worker's last rows and in-flight collectives reach the trace (3 s, then SIGKILL, lost
    them)."""
    from scheduler.parallel.launch import KILL_GRACE_S, stop_workers

    late = KILL_GRACE_S + 1.0  # the handler runs this late, as after a receive's timeout
    code = ("import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, lambda *a: (time.sleep({late}), sys.exit(0)))\n"
            "print('ready', flush=True)\ntime.sleep(60)\n")
    for wait_s, want in ((late + 2.0, 0), (0.0, -9)):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert stop_workers([p], graceful=False, wait_s=wait_s) == [want]
