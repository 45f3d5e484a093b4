"""Fault injection and the tooling that must catch it: leaks and GC,
fragmentation and defragmentation, slow sender, starvation."""

from __future__ import annotations

import collections
import json
import re

import pytest

from scheduler.config import EngineConfig
from scheduler.harness.workload import SyntheticSpec, synthetic_workload
from tests.support.cli import mstrace
from tests.support.engines import fragmenting_workload, run_engine
from tests.support.exact import F32
from tracing.reader import read_table


def test_contiguous_layout_defragments_and_keeps_tokens_exact():
    items = fragmenting_workload()
    paged = run_engine(EngineConfig(cpu_device="thread", model="tiny", block_size=16, kv_blocks=64, watermark_frac=0,
                                   **F32), items)
    contig = run_engine(EngineConfig(cpu_device="thread", model="tiny", block_size=16, kv_blocks=64, watermark_frac=0,
                                     kv_layout="contiguous", debug_kv_check=True, **F32), items)
    want = {r.request_id: r.output_ids for r in paged.rm.finished}
    got = {r.request_id: r.output_ids for r in contig.rm.finished}
    assert got == want and len(got) == 9
    assert contig.executor.device.kv_violations == []
    assert contig.mm.num_free == 64


def test_defrag_takes_the_blocks_a_finished_request_held_behind_the_kv_fence():
    """Overlap with split streams, contiguous runs: a request finished while its last round
    was in flight holds its run behind the KV fence. Defragmentation waits for the streams,
    so those blocks are free by then, and the runs move over them (they were taken for
    another request's, and the move raised)."""
    from scheduler.core.request import ReqSample, SamplingParams
    from scheduler.engine import Engine

    class Pending:
        done = False

        def query(self) -> bool:
            return self.done

    eng = Engine(EngineConfig(cpu_device="thread", model="tiny", block_size=16, kv_blocks=40, watermark_frac=0,
                              kv_layout="contiguous", mode="overlap"))
    try:
        assert eng.fence.split
        reqs = {}
        for rid in ("a", "x", "b"):  # runs 0-9, 10-19, 20-29
            r = eng.rm.enqueue(ReqSample(rid, [1, 2, 3], 3, SamplingParams(4), 1, 2))
            r.block_table = eng.mm.allocate_run(rid, 10)
            eng.rm.admit(r)
            reqs[rid] = r
        eng.mm.free("x", reqs["x"].block_table)
        reqs["x"].block_table = []
        eng.rm.running.remove(reqs["x"])
        last = Pending()  # a's last round, in flight as it finished
        eng.rm.running.remove(reqs["a"])
        eng.fence.release(reqs["a"], [last])
        assert eng.fence.blocks == 10 and eng.mm.num_free == 20
        last.done = True  # the streams finish it; the defrag waits for them first
        eng._defrag(1)
        assert reqs["b"].block_table == list(range(10)) and eng.mm.num_free == 30 and not eng.fence
    finally:
        eng.close()


def test_defrag_pause_is_in_the_trace(tmp_path):
    import json

    wl = tmp_path / "frag.jsonl"
    wl.write_text("\n".join(json.dumps(it.to_json()) for it in fragmenting_workload()) + "\n")
    out = tmp_path / "t"
    p = mstrace("run", "--model", "tiny", "--workload", str(wl), "--kv-layout", "contiguous", "--block-size", "16",
                "--kv-blocks", "64", "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    probes = read_table(out, "probes").to_pydict()
    host_defrag = [d for b, s, d in zip(probes["boundary"], probes["stream"], probes["dur_ns"], strict=True)
                   if b == "defrag" and s == "host"]
    tl = read_table(out, "timeline").to_pydict()
    big = [(s, v, t) for r, s, v, t in zip(tl["request_id"], tl["stage"], tl["value"], tl["ts_ns"], strict=True) if r == "big"]
    assert len(host_defrag) >= 1 and all(d > 0 for d in host_defrag), big
    stages = collections.Counter(read_table(out, "timeline").to_pydict()["stage"])
    assert stages["defrag_moved"] >= 1
    rep = json.loads(mstrace("report", str(out), "--json").stdout)
    assert any(b["boundary"] == "defrag" and b["device_share"] > 0 and b["host_share"] > 0 for b in rep["boundaries"])
    req = read_table(out, "requests").to_pydict()
    assert sorted(req["finish_reason"]) == ["length"] * 9


def test_leak_injection_without_gc_leaves_exactly_one_request_holding(tmp_path):
    cfg = EngineConfig(cpu_device="thread", model="tiny", inject=("leak",), gc=False)
    items = synthetic_workload(SyntheticSpec(12, (10, 60), (4, 20), 0.0, seed=1), 500, {0, 1, 2})
    eng = run_engine(cfg, items)
    leaked = [r for r in eng.rm.finished if r.block_table]
    assert len(leaked) == 1 and "injected" in leaked[0].finish_detail
    assert set(eng.mm.tables) == {leaked[0].request_id}
    assert eng.mm.num_free == eng.mm.num_blocks - len(set(leaked[0].block_table))


def test_leak_injection_with_gc_reclaims_and_pool_ends_full():
    cfg = EngineConfig(cpu_device="thread", model="tiny", inject=("leak",), gc_after_s=0.0)
    items = synthetic_workload(SyntheticSpec(12, (10, 60), (4, 20), 0.0, seed=1), 500, {0, 1, 2})
    eng = run_engine(cfg, items)
    assert eng.mm.num_free == eng.mm.num_blocks and not eng.mm.tables


@pytest.mark.parametrize("seed", range(20))
def test_clean_randomized_runs_never_leak(seed):
    """Seeded random workloads through random engine settings: no block is ever lost."""
    import random

    rng = random.Random(seed)
    mode = rng.choice(["serial", "timeslice", "overlap"])
    cfg = EngineConfig(cpu_device="thread", model="tiny", mode=mode, block_size=rng.choice([4, 8, 16]),
                       kv_blocks=rng.choice([24, 40, 80, 400]), prefill_chunk=rng.choice([16, 64, 512]),
                       timeslice_chunk=rng.choice([8, 32]), split_streams=rng.random() < 0.5,
                       prefill_max_wait_ms=rng.choice([0.0, 5.0, 50.0, 2000.0]), gc=False, probes=False)
    spec = SyntheticSpec(rng.randint(4, 24), (1, 90), (1, 60), rng.random(), rng.choice([4, 16]),
                         seed=seed)
    # A few hundred rounds at most; 20000 means the scheduler is going round in circles.
    eng = run_engine(cfg, synthetic_workload(spec, 500, {0, 1, 2}), max_steps=20000)
    assert len(eng.rm.finished) == spec.requests
    assert eng.mm.num_free == eng.mm.num_blocks and not eng.mm.tables
    eng.mm.check_invariants([])


def test_slow_sender_does_not_slow_the_engine(tmp_path):
    out = tmp_path / "s"
    p = mstrace("run", "--model", "tiny", "--requests", "12", "--output-len", "20-40", "--inject", "slow-sender",
                "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    probes = read_table(out, "probes").to_pydict()
    deliver = [d for b, d in zip(probes["boundary"], probes["dur_ns"], strict=True) if b == "response_deliver"]
    send = [d for b, d in zip(probes["boundary"], probes["dur_ns"], strict=True) if b == "response_send"]
    assert min(deliver) >= 50e6  # the cause: every delivery takes the injected 50 ms
    # bounded by the delivery, not by this host's speed: a scheduler waiting on the sender would
    # take a delivery's 50 ms a hand-off and a round
    assert sorted(send)[len(send) // 2] < min(deliver) / 10  # the hand-off stays cheap: the scheduler never waits
    steps = read_table(out, "steps").to_pydict()
    assert max(steps["out_queue_depth"]) > 5  # the backlog is visible
    assert sorted(steps["dur_ns"])[len(steps["dur_ns"]) // 2] < min(deliver)  # rounds stay short
    # the report shows what the client saw: every request's end reached it 50 ms or more
    # after the engine finished it (issue 12, point 6)
    lat = json.loads(mstrace("report", str(out), "--json").stdout)["latency"]
    assert lat["delivery_lag_ms"]["p50"] >= 50 and lat["delivery_lag_ms"]["count"] == 12
    assert lat["delivered_e2e_ms"]["p99"] > lat["e2e_ms"]["p99"] + 50
    assert "E2E delivered ms" in mstrace("report", str(out)).stdout


def test_starve_injection_completes_through_preemption(tmp_path):
    out = tmp_path / "st"
    p = mstrace("run", "--model", "tiny", "--requests", "6", "--prompt-len", "200-300", "--output-len", "8-16",
                "--kv-blocks", "256", "--inject", "starve", "--prefill-max-wait-ms", "0", "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    req = read_table(out, "requests").to_pydict()
    assert len(req["request_id"]) == 10 and set(req["finish_reason"]) == {"length"}
    tl = read_table(out, "timeline").to_pydict()
    assert "preempted" in tl["stage"]
    # the cause is in the trace: a reason per preemption, naming the prefill it made room for
    assert sum(req["num_preemptions"]) == tl["stage"].count("preempted") > 0
    for rid, n, why in zip(req["request_id"], req["num_preemptions"], req["preempt_reasons"], strict=True):
        assert len(why) == n and all(why), (rid, why)
    starved = [w for why in req["preempt_reasons"] for w in why if re.fullmatch(r"\S+ waited \d+ ms for blocks", w)]
    assert starved and all(w.split()[0] in req["request_id"] for w in starved), req["preempt_reasons"]


@pytest.mark.slow
def test_starve_preempts_on_the_default_pool_and_says_what_it_added(tmp_path):
    """No --kv-blocks, no --prefill-max-wait-ms: the injection sizes its pins to the pool
    and the model's context itself (issue 12, point 6)."""
    out = tmp_path / "st"
    p = mstrace("run", "--model", "tiny", "--requests", "16", "--inject", "starve", "--out", str(out), "-q",
                timeout=240)
    assert p.returncode == 0, p.stderr
    assert "--inject starve: added" in p.stderr and "starve-pin-0.." in p.stderr
    req = read_table(out, "requests", ["request_id", "finish_reason", "num_preemptions"]).to_pydict()
    assert set(req["finish_reason"]) == {"length"}  # nothing rejected: every pin fits the model's context
    assert sum(req["num_preemptions"]) > 0
