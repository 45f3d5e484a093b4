"""Split streams in `mstrace whatif` (viewer/analysis/whatif_streams.py, whatif_model.two_streams):
the two queues on hand-made batches, and a real serial trace cut into the parts a split run
would run; and a forward's cold start after an idle device."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.cli import mstrace
from tests.support.whatif_batches import random_drains
from tests.test_whatif import MS, SAMPLES, batches
from viewer.analysis import native
from viewer.analysis.whatif import whatif
from viewer.analysis.whatif_fit import _cold_starts, load
from viewer.analysis.whatif_model import (
    COMPONENTS,
    Batches,
    StreamShare,
    critical_path,
    replay,
    simulate,
    two_streams,
)
from viewer.analysis.whatif_probe import MIN_SHARE, Probe, measured, replayed, rounds, stream_share
from viewer.analysis.whatif_share import Rates, Sharing
from viewer.analysis.whatif_streams import Cost, converted, parts_alone


def test_two_parts_share_the_device_then_the_longer_goes_alone():
    # 4 of decodes and 2 of prefill, each at half speed beside the other: the prefill ends at
    # 4 (2 of the decodes done), the decodes' other 2 alone: 6
    assert two_streams(0.0, 0.0, 0.0, 0.0, 4.0, 2.0, StreamShare(0.5, 0.5)) == pytest.approx((0.0, 0.0, 6.0, 4.0))
    # the main stream still runs the batch before until 3; its decodes start a turn (0.5) later
    assert two_streams(1.0, 3.0, 0.0, 0.5, 2.0, 3.0, StreamShare(1.0, 1.0)) == pytest.approx((3.0, 3.5, 5.5, 4.0))
    # a turn is no work: the prefill goes at full speed beside it
    assert two_streams(0.0, 0.0, 0.0, 1.0, 2.0, 1.0, StreamShare(0.5, 0.5)) == pytest.approx((0.0, 1.0, 3.0, 1.0))
    # the decodes wait for the prompts the batch before's prefill finished
    assert two_streams(2.0, 0.0, 2.0, 0.0, 1.0, 0.0, StreamShare(0.5, 0.5)) == pytest.approx((2.0, 2.0, 3.0, 2.0))


comp = st.floats(min_value=0.0, max_value=5.0, allow_nan=False)
rate = st.floats(min_value=0.05, max_value=1.0, allow_nan=False)


def _random(data: st.DataObject, n: int, with_pre: bool) -> Batches:
    arr = {c: np.array(data.draw(st.lists(comp, min_size=n, max_size=n))) * MS for c in COMPONENTS}
    arr["A"] = np.zeros(n)  # one rank: split streams never run beside TP's all-reduces
    arr["D"] += 0.01 * MS  # every batch has device work (one without would have no turn either)
    if not with_pre:
        arr["D_pre"] = np.zeros(n)
    return Batches(**arr, not_before=np.zeros(n), **random_drains(data, n))


TIMELINE = ("start", "launched", "ended", "launches", "collects", "dev_start", "dev_end", "synced", "held", "turn",
            "busy")


@pytest.mark.skipif(not native.AVAILABLE, reason="the install built no C kernels")
@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 14), overlap=st.booleans(), split=st.sampled_from([None, (0.5, 0.5), (0.3, 0.9), (1.0, 1.0)]),
       with_pre=st.booleans(), cold=st.sampled_from([0.0, 0.4, 3.0]), traced=st.booleans(), data=st.data())
def test_the_c_replay_is_the_python_one_to_the_bit(n, overlap, split, with_pre, cold, traced, data):
    """`simulate` (C) against `replay` (its Python reference): the same doubles in the same order,
    negative turns and launches, arrivals, drains, cold starts found or as traced, one or two streams."""
    b = _random(data, n, with_pre)
    ms = st.lists(st.floats(-1, 1, allow_nan=False), min_size=n, max_size=n)
    b = replace(b, T=np.maximum(np.array(data.draw(ms)) * MS, -np.concatenate([[0.0], b.D[:-1]])),
                L=np.maximum(np.array(data.draw(ms)) * MS, -b.P_prep), A=np.zeros(n) if split else b.A,
                not_before=np.sort(np.array(data.draw(st.lists(st.floats(0, 40), min_size=n, max_size=n)))) * MS,
                cold=cold * MS)
    cold_at = np.array(data.draw(st.lists(st.booleans(), min_size=2 * n, max_size=2 * n))).reshape(n, 2) \
        if traced else None
    share = StreamShare(*split) if split else None
    c, py = simulate(b, overlap, share, cold_at), replay(b, overlap, share, cold_at)
    for f in TIMELINE:
        assert np.array_equal(getattr(c, f), getattr(py, f), equal_nan=True), f
    assert c.end == py.end


@pytest.mark.skipif(not native.AVAILABLE, reason="the install built no C kernels")
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("split", [None, (0.5, 0.5)])
def test_the_c_replay_breaks_ties_as_the_python_one(overlap, split):
    """Ties random durations never draw: a device idle exactly COLD_GAP_NS before a batch (0.5 ms
    of prepare), and a batch's decodes and prefill ending together (1 ms each at half speed)."""
    b = replace(batches(6, P_prep=0.5, D=1.0, D_pre=1.0 if split else 0.0), cold=0.1 * MS)
    share = StreamShare(*split) if split else None
    c, py = simulate(b, overlap, share), replay(b, overlap, share)
    for f in TIMELINE:
        assert np.array_equal(getattr(c, f), getattr(py, f), equal_nan=True), f


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 12), overlap=st.booleans(), m=rate, p=rate, data=st.data())
def test_without_prefill_parts_two_streams_are_one(n, overlap, m, p, data):
    b = _random(data, n, with_pre=False)
    one, two = simulate(b, overlap), simulate(b, overlap, StreamShare(m, p))
    assert two.end == pytest.approx(one.end, rel=1e-9, abs=1e-3)
    assert two.synced == pytest.approx(one.synced, rel=1e-9, abs=1e-3)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 12), overlap=st.booleans(), m=rate, p=rate, data=st.data())
def test_the_critical_path_of_two_streams_is_the_whole_run(n, overlap, m, p, data):
    b = _random(data, n, with_pre=True)
    tl = simulate(b, overlap, StreamShare(m, p))
    assert sum(critical_path(b, tl).values()) == pytest.approx(tl.end, rel=1e-9, abs=1e-3)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 12), overlap=st.booleans(), data=st.data())
def test_streams_that_do_not_slow_each_other_never_lengthen_the_run(n, overlap, data):
    b = _random(data, n, with_pre=True)
    assert simulate(b, overlap, StreamShare(1.0, 1.0)).end <= simulate(b, overlap).end + 1e-3


@pytest.mark.parametrize("share", [StreamShare(0.2, 0.3), StreamShare(0.8, 0.6), StreamShare(1.0, 1.0)])
def test_a_split_trace_replays_as_it_ran_whatever_the_streams_rates(share):
    """Each part's time beside the other stream is taken out at the share and put back the
    same way: where the model starts every part where the trace did, the replay does not
    depend on the share (the sample's split overlap trace)."""
    run = load(SAMPLES / "sample-overlap")
    assert run.split and run.batches.D_pre.any()

    def end(s: StreamShare) -> float:
        return simulate(parts_alone(run, run.batches, s), True, s).end

    assert end(share) == pytest.approx(end(StreamShare()), rel=1e-9)
    # one stream: no forward starts before its launch is done, as a split round's first part may
    assert run.batches.L.min() < 0 and converted(run, run.batches, False).L.min() >= 0
    assert parts_alone(run, run.batches, share).D_pre.sum() != parts_alone(run, run.batches, StreamShare()).D_pre.sum()


def test_the_cost_fit_finds_a_known_cost():
    rng = np.random.default_rng(0)
    dec, pre = rng.integers(0, 200, 300).astype(float), rng.integers(0, 512, 300).astype(float)
    t = 800e3 + 40e3 * dec + 7e3 * pre
    c = Cost.fit(t, dec, pre)
    assert (c.fixed, c.per_decode, c.per_prefill) == pytest.approx((800e3, 40e3, 7e3), rel=1e-6)
    # a negative term is dropped, not kept: no cost is negative
    assert Cost.fit(1e6 - 10.0 * pre, np.zeros(300), pre).per_prefill == 0.0


@pytest.fixture(scope="module")
def serial_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("streams") / "serial"
    p = mstrace("run", "--model", "tiny", "--requests", "24", "--prompt-len", "16-200", "--output-len", "8-24",
                "--seed", "5", "--cpu-device", "process", "-q", "--out", str(out))
    assert p.returncode == 0, p.stderr
    return out


def test_a_serial_forward_is_cut_into_the_parts_a_split_run_runs(serial_trace):
    run = load(serial_trace)
    assert not run.split
    share, source = stream_share(run.trace.meta)
    assert source == "measured at start-up" and 0 < share.main <= 1 and 0 < share.prefill <= 1
    b = parts_alone(run, run.batches, share)  # a serial trace: as it ran
    assert b.D is run.batches.D
    s = converted(run, b, True)
    dec, pre = run.decode_tokens > 0, run.prefill_tokens > 0
    total = b.D + b.D_pre
    assert s.D[dec & ~pre] == pytest.approx(total[dec & ~pre])  # decodes only: all on main
    assert s.D_pre[pre & ~dec] == pytest.approx(total[pre & ~dec]) and not s.D[pre & ~dec].any()
    both = dec & pre
    assert both.any()
    # each mixed batch keeps its total, plus the second forward's fixed cost (scaled as the batch)
    assert np.all(s.D[both] + s.D_pre[both] >= total[both]) and np.all(s.D[both] > 0) and np.all(s.D_pre[both] > 0)
    back = converted(run, b, False)
    assert back is b  # already one stream


def test_a_trace_replays_the_same_with_its_cold_starts_taken_out_and_put_back(serial_trace):
    """The replay starts cold the parts the fit found cold, whatever its own rebuilt gaps say
    (one of them near 0.5 ms used to add or drop one: docs/whatif.md)."""
    run = load(serial_trace)
    assert run.cold_at[0, 0]  # the first batch at least (most of a serial run's: the host's round between)
    # whatever the probe measured (a noisy machine's median can be 0): the property holds for any
    point = dataclasses.replace(measured(run.trace.meta)[0], cold_ns=0.5 * MS)
    _, with_cold = replayed(run, point, False)
    _, without = replayed(run, dataclasses.replace(point, cold_ns=0.0), False)
    assert with_cold.end == pytest.approx(without.end, rel=1e-9)
    assert with_cold.synced == pytest.approx(without.synced, rel=1e-9)


def test_whatif_says_what_it_did_with_the_streams(serial_trace):
    r = whatif(serial_trace, "overlap")
    assert (r.split_streams, r.target_split_streams) == (False, True)
    assert r.streams_source == "measured at start-up"
    p = mstrace("whatif", str(serial_trace), "--mode", "overlap")
    assert p.returncode == 0, p.stderr
    assert "split streams off -> on" in " ".join(p.stdout.split())
    # the trace's own mode: its own setting, nothing cut
    assert whatif(serial_trace).target_split_streams is False


def test_a_forward_on_an_idle_device_pays_the_cold_start():
    cold = 0.4 * MS
    b = replace(batches(20, P_prep=1, D=3, Q_book=0.5, G=0.2), cold=cold)
    plain = replace(b, cold=0.0)
    # serial: the device idles through every host round (1.7 ms), so every batch pays it
    assert simulate(b, False).end == pytest.approx(simulate(plain, False).end + 20 * cold)
    # overlap, device-bound: batches back to back, only the first starts on an idle device
    assert simulate(b, True).end == pytest.approx(simulate(plain, True).end + cold)
    # two streams: the first part to start on the idle device, once: the first batch's
    # prefill, which at half speed beside its decodes (each its share of the device) delays
    # them by all of it
    split = replace(b, D_pre=np.full(20, 1 * MS))
    half = StreamShare(0.5, 0.5)
    assert simulate(split, True, half).end == pytest.approx(simulate(replace(split, cold=0.0), True, half).end + cold)


def test_a_decode_only_batch_held_by_its_turn_pays_the_cold_start():
    # the main stream ran batch 0 past the launch of batch 1 (decodes only), then turned for
    # 1 ms: the device idled 1 ms, so batch 1 starts cold too
    b = replace(batches(2, P_prep=1, D=3, T=1), cold=0.4 * MS)
    tl = simulate(b, True, StreamShare(1.0, 1.0))
    assert tl.dev_end[1] - tl.dev_start[1] == pytest.approx(3.4 * MS)
    # a part shorter than the cold start gets back what the fit took off it: half of it as it ran
    short = replace(batches(2, P_prep=5, D=0.3), cold=0.4 * MS)
    assert simulate(short, False).dev_end[0] == pytest.approx(5 * MS + 0.6 * MS)


def test_cold_starts_are_the_stretches_after_an_idle_device():
    start = np.array([0.0, 1.0, 2.9, np.nan, 10.0, 3.0]) * MS
    end = np.array([2.0, 2.5, 4.0, np.nan, 11.0, 3.2]) * MS
    # the first; 1.0 began beside 0; 2.9 after 0.4 ms idle; none; 10.0 after 6 ms; 3.0 beside 2.9
    assert _cold_starts(start, end).tolist() == [True, False, False, False, True, False]


def test_the_probes_rounds_become_the_intervals_draws():
    rec = {"prepare": {"rounds": [[0.9, 1.2], [0.5, 0.6]]}, "python": {"rounds": [[-0.1, 1.0], [0.2, 0.9]]},
           "streams": {"rounds": [[0.6, 0.7], [0.0, 0.5]]}, "cold_rounds": [0.3, -0.1]}
    point = Probe(Sharing(), StreamShare(), 0.0)
    got = rounds({"contention": rec, "config": {"cpu_device": "process"}}, point, False)
    assert [p.share for p in got] == [Sharing(Rates(0.9, 1.0), Rates(0.0, 1.0)), Sharing(Rates(0.5, 0.6), Rates(0.2, 0.9))]
    assert [p.streams for p in got] == [StreamShare(0.6, 0.7), StreamShare(MIN_SHARE, 0.5)]
    assert [p.cold_ns for p in got] == pytest.approx([0.3 * MS, 0.0])
    # a device thread's cold start is not the model's; --contention's rates stay as given
    given = Probe(Sharing.contention(0.5), StreamShare(), 0.0)
    thread = rounds({"contention": rec, "config": {"cpu_device": "thread"}}, given, True)
    assert all(p.cold_ns == 0 and p.share == given.share for p in thread)
    # lists that disagree, or a record from before the probe had them: the medians alone
    assert rounds({"contention": {**rec, "cold_rounds": [0.3]}}, point, False) == []
    assert rounds({"contention": {"why": "a GPU computes beside the host"}}, point, False) == []
