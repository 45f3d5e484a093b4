"""`mstrace diff`: the bootstrap sees a real 2 ms shift and no shift in identical
inputs, its statistics are the report's, warnings catch unfair comparisons, and
bad traces are refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from tests.cli import mstrace
from viewer.analysis import diff as D
from viewer.analysis.cost import cost_table
from viewer.analysis.serving import Dist, serving_metrics


def cycles(n: int, bookkeeping_ms: float, seed: int) -> tuple[pa.Table, pa.Table]:
    """n back-to-back serial cycles: device compute, then bookkeeping, batch_prepare,
    response_send on the host; the barrier waits for the device. Each duration is noisy."""
    rng = np.random.default_rng(seed)
    dev = rng.normal(5e6, 5e5, n).astype(np.int64)
    bk = rng.normal(bookkeeping_ms * 1e6, 1e5, n).astype(np.int64)
    prep = rng.normal(5e5, 5e4, n).astype(np.int64)
    send = rng.normal(1e5, 1e4, n).astype(np.int64)
    length = dev + bk + prep + send
    start = np.concatenate([[0], np.cumsum(length)[:-1]]) + 10**9
    rows = [(start, dev, "device_compute"), (start, dev, "scheduler_barrier"), (start + dev, bk, "bookkeeping"),
            (start + dev + bk, prep, "batch_prepare"), (start + dev + bk + prep, send, "response_send")]
    probes = pa.table({
        "ts_ns": np.concatenate([r[0] for r in rows]),
        "dur_ns": np.concatenate([r[1] for r in rows]),
        "boundary": pa.array([r[2] for r in rows for _ in range(n)]).dictionary_encode(),
        "rank": np.zeros(5 * n, np.int32),
    })
    steps = pa.table({"step": np.arange(n), "mode": pa.array(["serial"] * n).dictionary_encode(),
                      "ts_ns": start, "dur_ns": length, "blocks_used": np.zeros(n, np.int32)})
    return probes, steps


def requests(n: int, ttft_ms: float, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.integers(0, 10**9, n))
    first = arrival + rng.normal(ttft_ms * 1e6, 2e6, n).astype(np.int64)
    out_len = rng.integers(8, 32, n)
    tokens = [f + np.concatenate([[0], np.cumsum(rng.integers(4 * 10**6, 6 * 10**6, k - 1))])
              for f, k in zip(first, out_len, strict=True)]
    return pa.table({
        "arrival_ns": arrival, "first_token_ns": first, "finish_ns": [t[-1] for t in tokens],
        "prompt_len": rng.integers(16, 64, n).astype(np.int32), "output_len": out_len.astype(np.int32),
        "dur_itl_ns": pa.array([np.diff(t).tolist() for t in tokens], pa.list_(pa.int64())),
        "finish_reason": ["length"] * n, "num_preemptions": np.zeros(n, np.int32),
    })


def test_bootstrap_sees_a_2ms_shift():
    d = D.diff_cycles(*cycles(400, 1.0, 1), *cycles(400, 3.0, 2))
    bk = d["boundaries"]["bookkeeping"]["mean_ms"]
    assert bk.delta == pytest.approx(2.0, abs=0.05) and bk.significant
    assert 1.9 < bk.ci_low < bk.delta < bk.ci_high < 2.1
    # serial: the whole 2 ms is exposed, so the cycle grows by it and the device idles more
    assert d["cycle_ms"].delta == pytest.approx(2.0, abs=0.15) and d["cycle_ms"].significant
    assert d["boundaries"]["bookkeeping"]["share"].significant and d["device_idle"].significant
    assert not d["boundaries"]["batch_prepare"]["mean_ms"].significant


def test_identical_inputs_are_not_significant():
    p, s = cycles(300, 1.0, 1)
    d = D.diff_cycles(p, s, p, s)
    deltas = [d["cycle_ms"], d["device_idle"], *(x for row in d["boundaries"].values() for x in row.values())]
    for x in deltas:
        if x.a is None:
            continue
        assert x.delta == 0 and not x.significant
        if x.ci_low is not None:  # a constant statistic (hidden 0%) has the interval [0, 0]
            assert x.ci_low <= 0 <= x.ci_high
    assert d["boundaries"]["bookkeeping"]["mean_ms"].ci_low < 0 < d["boundaries"]["bookkeeping"]["mean_ms"].ci_high
    r = requests(200, 20.0, 3)
    dr = D.diff_requests(r, r)
    for x in [*dr["throughput"].values(), *(v for lat in dr["latency"].values() for v in lat.values())]:
        assert x.delta == 0 and x.ci_low <= 0 <= x.ci_high and not x.significant


def test_request_bootstrap_sees_a_ttft_shift_and_not_noise():
    dr = D.diff_requests(requests(300, 20.0, 1), requests(300, 22.0, 2))
    assert dr["latency"]["ttft_ms"]["mean"].significant
    assert dr["latency"]["ttft_ms"]["mean"].delta == pytest.approx(2.0, abs=0.5)
    # inter-token gaps come from the same distribution on both sides
    assert not dr["latency"]["itl_ms"]["p50"].significant


def test_point_estimates_are_the_reports():
    p, s = cycles(200, 1.0, 4)
    r = requests(150, 20.0, 4)
    ct, sv = cost_table(p, s), serving_metrics(r)
    d, dr = D.diff_cycles(p, s, p, s), D.diff_requests(r, r)
    assert d["cycle_ms"].a == pytest.approx(ct.cycle_ms) and d["device_idle"].a == pytest.approx(1 - ct.device_busy)
    for b in ct.boundaries:
        row = d["boundaries"][b.boundary]
        assert row["mean_ms"].a == pytest.approx(b.mean_ms)
        assert row["share"].a == (None if b.share is None else pytest.approx(b.share))
        assert row["hidden"].a == (None if b.hidden is None else pytest.approx(b.hidden))
    for k in D.THROUGHPUT:
        assert dr["throughput"][k].a == pytest.approx(getattr(sv, k))
    for lat in D.LATENCIES:
        for q in ("mean", "p50", "p90", "p99"):
            assert dr["latency"][lat][q].a == pytest.approx(getattr(getattr(sv, lat), q)), (lat, q)


@pytest.mark.parametrize("step", [None, 1, 3, 50])
def test_pooled_percentiles_match_materialised_resamples(step):
    rng = np.random.default_rng(7)
    for _ in range(20):
        groups, n = int(rng.integers(1, 25)), int(rng.integers(1, 300))
        values = rng.integers(0, 40, n).astype(float)  # ties on purpose
        owner = rng.integers(0, groups, n)
        w = np.vstack([np.ones((1, groups)), np.zeros((1, groups)), D.resample_weights(groups, 30, rng)])
        got = D.PooledDist(values, owner, groups, 0.5, step)(w)
        for r in range(len(w)):
            xs = np.repeat(values, w[r][owner].astype(int))
            if not len(xs):
                assert all(np.isnan(got[k][r]) for k in got)
                continue
            want = Dist.of(xs, 0.5)
            for k in ("mean", "p50", "p90", "p99"):
                assert got[k][r] == pytest.approx(getattr(want, k), rel=1e-12, abs=1e-12)


def test_blocks_do_not_change_the_answer(monkeypatch):
    a, b = cycles(300, 1.0, 1), cycles(300, 3.0, 2)
    whole = D.diff_cycles(*a, *b)["boundaries"]["bookkeeping"]["mean_ms"]
    monkeypatch.setattr(D, "BLOCK_ELEMS", 1000)  # 3 rows per block
    blocked = D.diff_cycles(*a, *b)["boundaries"]["bookkeeping"]["mean_ms"]
    assert blocked.delta == whole.delta and blocked.significant
    assert blocked.ci_low == pytest.approx(whole.ci_low, abs=0.05)


def test_block_resampling_draws_runs_of_consecutive_cycles():
    rng = np.random.default_rng(0)
    w = D.resample_weights(100, 500, rng, block=5)
    assert w.shape == (500, 100) and (w.sum(axis=1) == 100).all()
    # circular: every cycle, the first and last included, is drawn once on average
    assert np.abs(w.mean(axis=0) - 1).max() < 0.25 and w[:, 0].mean() == pytest.approx(1, abs=0.25)
    for row in w[:20]:  # drawn cycles come in runs of >= 5 neighbours (around the circle), but for one cut run
        drawn = np.flatnonzero(row)
        runs = np.split(drawn, np.flatnonzero(np.diff(drawn) > 1) + 1)
        if len(runs) > 1 and runs[0][0] == 0 and runs[-1][-1] == 99:  # a run that wraps around
            runs = [np.concatenate([runs[-1], runs[0]]), *runs[1:-1]]
        assert sum(len(r) < 5 for r in runs) <= 1
    assert D.cycle_block(1) == 1 and D.cycle_block(141) == 5 and D.cycle_block(1_000_000) == 100


def test_block_bootstrap_widens_the_interval_of_correlated_cycles():
    """Cycles in slow phases (a drift plus noise): one-by-one resampling would call a
    difference the phases explain significant far more often than blocks do."""
    rng = np.random.default_rng(1)
    n = 400
    phase = np.repeat(rng.normal(0, 1, n // 40), 40)  # 10 phases of 40 cycles
    x = 5 + phase + rng.normal(0, 0.2, n)

    def width(block: int) -> float:
        s = D.bootstrap(n, 400, np.random.default_rng(2), lambda w: {"m": w @ x / w.sum(axis=1)}, block)["m"]
        return float(np.percentile(s[1:], 97.5) - np.percentile(s[1:], 2.5))

    assert width(D.cycle_block(n)) > 1.5 * width(1)


def test_warnings():
    meta = {"workload": {"digest": "a" * 64}, "model": {"name": "tiny", "path": "/m/tiny", "architecture": "L"},
            "host": {"device": "cpu"}, "config": {"mode": "serial"}}
    other_mode = json.loads(json.dumps(meta))
    other_mode["config"]["mode"] = "overlap"
    assert D.trace_warnings(meta, other_mode) == []
    other = json.loads(json.dumps(meta))
    other["workload"]["digest"] = "b" * 64
    other["model"]["name"] = "default"
    w = D.trace_warnings(meta, other)
    assert len(w) == 2 and "different workloads" in w[0] and "different models" in w[1] and "name" in w[1]


# --- end to end -------------------------------------------------------------------------------

RUN = ["run", "--model", "tiny", "--requests", "16", "-q"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("diff")
    for name, extra in (("a", []), ("b", ["--debug-bookkeeping-sleep-ms", "2"]), ("c", ["--seed", "1"]),
                        ("np", ["--no-probes"])):
        p = mstrace(*RUN, "--out", str(root / name), *extra)
        assert p.returncode == 0, p.stderr
    return root


def diff_json(a, b):
    p = mstrace("diff", str(a), str(b), "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_diff_sees_injected_bookkeeping(traces):
    d = diff_json(traces / "a", traces / "b")
    assert {"a", "b", "delta", "warnings"} <= set(d)
    assert not any("workload" in w for w in d["warnings"]), d["warnings"]
    bk = d["delta"]["boundaries"]["bookkeeping"]["mean_ms"]
    # +2 ms injected per round. One-sided slack: on a loaded machine the spin at the end
    # of the injected sleep gets descheduled now and then, which only ever adds time.
    assert 1.8 <= bk["delta"] <= 2.6, bk
    assert bk["significant"] and bk["ci_low"] > 0
    assert bk["a"] == pytest.approx(next(x["mean_ms"] for x in d["a"]["boundaries"] if x["boundary"] == "bookkeeping"))
    assert d["a"]["mode"] == "serial" and d["a"]["device_idle"] == pytest.approx(1 - d["a"]["device_busy"])
    for lat in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(d["delta"]["latency"][lat]) == {"mean", "p50", "p90", "p99"}
        assert d["delta"]["latency"][lat]["p50"]["a"] == pytest.approx(d["a"]["latency"][lat]["p50"])
    assert set(d["delta"]["throughput"]) == {"output_tok_per_s", "input_tok_per_s", "request_per_s"}

    text = mstrace("diff", str(traces / "a"), str(traces / "b"))
    assert text.returncode == 0, text.stderr
    assert "A serial" in text.stdout and "bookkeeping" in text.stdout and "device idle" in text.stdout


def test_diff_warns_on_different_workloads(traces):
    d = diff_json(traces / "a", traces / "c")
    assert any("different workloads" in w for w in d["warnings"]), d["warnings"]
    text = mstrace("diff", str(traces / "a"), str(traces / "c")).stdout
    assert "warning: the two traces ran different workloads" in text


def test_diff_without_probes_compares_serving_only(traces):
    d = diff_json(traces / "a", traces / "np")
    assert any("--no-probes" in w for w in d["warnings"]) and not any("workload" in w for w in d["warnings"])
    assert d["delta"]["boundaries"] == {} and d["delta"]["device_idle"]["delta"] is None
    assert d["delta"]["cycle_ms"]["a"] > 0 and d["delta"]["latency"]["ttft_ms"]["p50"]["b"] > 0
    assert mstrace("diff", str(traces / "a"), str(traces / "np")).returncode == 0


def test_diff_missing_trace(traces, tmp_path):
    for args in ((traces / "a", tmp_path / "nope"), (tmp_path / "nope", traces / "a")):
        p = mstrace("diff", *map(str, args))
        assert p.returncode == 2 and "trace not found" in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
