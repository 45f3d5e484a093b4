"""The engine's start-up contention probe (scheduler/device/contention.py): what it measures,
that it leaves the run as it was, and that `mstrace whatif` takes it from meta.json."""

from __future__ import annotations

import json

import pytest

from scheduler.device.contention import ROUNDS, rates
from tests.support.cli import mstrace
from tests.support.exact import F32_ARGS
from tracing.reader import Trace, read_table
from viewer.analysis.whatif import whatif
from viewer.analysis.whatif_share import Rates

RUN = ["run", "--model", "tiny", "--requests", "12", "--prompt-len", "16-48", "--output-len", "8-16", "--seed", "3",
       "-q", *F32_ARGS]  # the tokens of two runs are compared


def test_rates_read_back_both_orders():
    # device 10 and host 5 alone, each at half speed beside the other: the host takes 10, in
    # which the device does 5 of its 10, then 5 alone
    assert rates(10, 5, 15, 10) == pytest.approx((0.5, 0.5))
    # the device ends first (2 alone, 4 beside at half speed); the host did 1 of its 5 beside
    # it at a quarter speed, then 4 alone: 8 in all
    assert rates(2, 5, 4, 8) == pytest.approx((0.5, 0.25))
    assert rates(4, 2, 4, 2) == pytest.approx((1.0, 1.0))  # neither noticed the other


def _tokens(root):
    t = read_table(root, "requests", ["request_id", "output_ids"])
    return sorted(zip(t["request_id"].to_pylist(), t["output_ids"].to_pylist(), strict=True))


@pytest.mark.parametrize("device", ["thread", "process"])
def test_the_probe_measures_and_leaves_the_run_as_it_was(tmp_path, device):
    probed, plain = tmp_path / "probed", tmp_path / "plain"
    for out, extra in ((probed, []), (plain, ["--no-contention-probe"])):
        p = mstrace(*RUN, "--cpu-device", device, "--out", str(out), *extra)
        assert p.returncode == 0, p.stderr
    rec = Trace.open(probed).meta["contention"]
    for kind in ("prepare", "python"):
        r = rec[kind]
        assert 0 <= r["device_rate"] <= 1 and 0 <= r["host_rate"] <= 1 and len(r["rounds"]) == ROUNDS
        assert r["device_beside_ms"] > 0 and r["host_alone_ms"] > 0 and r["host_beside_ms"] > 0
    assert rec["device_alone_ms"] > 0 and rec["probe_ms"] > 0
    st = rec["streams"]  # the main stream's decodes beside the prefill stream's chunk
    assert 0 <= st["main_rate"] <= 1 and 0 <= st["prefill_rate"] <= 1 and len(st["rounds"]) == ROUNDS
    assert min(st["main_alone_ms"], st["prefill_alone_ms"], st["main_beside_ms"], st["prefill_beside_ms"]) > 0
    assert Trace.open(plain).meta["contention"] == {"why": "--no-contention-probe"}
    # its forwards wrote no probe rows (every device row belongs to a round) and changed no token
    probes = read_table(probed, "probes", ["stream", "step"])
    streams, steps = probes["stream"].to_pylist(), probes["step"].to_pylist()
    assert not [s for st, s in zip(streams, steps, strict=True) if st in ("main", "prefill") and s < 0]
    assert _tokens(probed) == _tokens(plain)
    # a device thread's streams: their recorded ops in all (the run's, not the probe's), for whatif
    threads = Trace.open(probed).meta["run"].get("device_stream_times")
    if device == "thread":
        t = read_table(probed, "probes", ["dur_ns", "boundary", "stream"])
        main = [d for d, b, st in zip(*(t[c].to_pylist() for c in ("dur_ns", "boundary", "stream")), strict=True)
                if st == "main" and b == "device_compute"]  # its forwards, not its waits for events
        assert threads["main"]["ops"] == len(main) and threads["main"]["wall_ns"] == sum(main)
        assert 0 < threads["main"]["cpu_ns"] <= threads["main"]["wall_ns"] * 1.05
    else:
        assert threads is None  # a device process runs them elsewhere
    # report says how much of the device threads' time they waited, in the text and --json alike
    p = mstrace("report", str(probed), "--json")
    share = json.loads(p.stdout)["backend"]["device_waiting_share"]
    assert (0 <= share < 1) if device == "thread" else share is None, share
    if device == "thread":
        text = " ".join(mstrace("report", str(probed)).stdout.split())
        assert f"ready but not running for {100 * share:.1f}% of their time" in text

    r = whatif(probed)
    assert r.contention_source == "measured at start-up"
    assert len(rec["cold_rounds"]) == ROUNDS  # measured on both; the model takes a device process's only
    assert r.cold_start_ms == pytest.approx(max(rec["cold_ms"], 0.0) if device == "process" else 0.0)
    for kind, got in (("prepare", r.rates_beside_prepare), ("python", r.rates_beside_python)):
        assert (got.device, got.host) == (rec[kind]["device_rate"], rec[kind]["host_rate"])
    given = whatif(probed, contention=0.25)
    assert given.contention_source == "given"
    assert given.rates_beside_prepare == given.rates_beside_python == Rates(0.75, 1.0)
    none = whatif(plain)
    assert none.rates_beside_prepare == none.rates_beside_python == Rates(1.0, 1.0)
    assert none.contention_source == "none measured (--no-contention-probe)"


def test_an_engine_without_a_trace_or_room_is_not_probed(tmp_path):
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from tracing.writer import TraceWriter

    eng = Engine(EngineConfig(cpu_device="thread", model="tiny", kv_blocks=64))
    try:
        assert eng.contention == {"why": "no trace to record it"}
    finally:
        eng.close()
    # a pool smaller than the probe's batch: the run goes on, and says why it was not probed
    w = TraceWriter(tmp_path / "t")
    eng = Engine(EngineConfig(cpu_device="thread", model="tiny", kv_blocks=64), trace=w)
    try:
        assert "cannot hold the contention probe's batch" in eng.contention["why"]
    finally:
        eng.close()
        w.close()


def test_a_bad_measurement_in_meta_is_not_used():
    from viewer.analysis.whatif_probe import sharing

    good = {"device_rate": 0.5, "host_rate": 0.5}
    s, why = sharing({"contention": {"prepare": good, "python": {"device_rate": float("nan"), "host_rate": 1}}})
    assert s.free and why.startswith("none measured (meta.json's contention holds rates outside 0-1")
    s, why = sharing({"contention": {"prepare": good, "python": good}})
    assert not s.free and why == "measured at start-up"
    assert sharing({})[1] == "none measured (a trace from before the probe)"
