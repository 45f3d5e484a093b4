"""`mstrace whatif`: the round model (viewer/analysis/whatif_model.py) on batches built by hand,
its fit on the sample traces, and its virtual speedups checked against the truth harness's
known delays."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probes.boundaries import IDLE
from tests.support.cli import REPO, cli, mstrace
from tests.support.whatif_batches import drains, random_drains
from viewer.analysis.whatif import Speedup, WhatIfError, whatif
from viewer.analysis.whatif_fit import load
from viewer.analysis.whatif_model import COMPONENTS, SCALES, Batches, critical_path, simulate
from viewer.analysis.whatif_probe import measured, replayed
from viewer.analysis.whatif_share import Rates, Sharing, shared, unshared

SAMPLES = REPO / "traces"
MS = 1e6


def batches(n: int, **ms: float) -> Batches:
    """n alike batches, each component in ms (0 unless given)."""
    arr = {c: np.full(n, ms.get(c, 0.0) * MS) for c in COMPONENTS}
    return Batches(**arr, not_before=np.zeros(n), **drains(n, ms.get("head_Q", 0.0) * MS, ms.get("tail_P", 0.0) * MS))


def test_serial_is_the_sum_of_its_parts():
    b = batches(10, P_prep=1, L=0.1, D=3, C=0.2, Q_book=0.5, G=0.2)
    tl = simulate(b, overlap=False)
    assert tl.end == pytest.approx(10 * (1 + 0.1 + 3 + 0.2 + 0.5 + 0.2) * MS)


def test_overlap_hides_the_host_under_a_longer_device():
    # the host's round (prepare 1 + post 0.7) is shorter than the device's 3 ms: after the
    # first batch the device never waits, so the run is the device's time plus the ends
    b = batches(50, P_prep=1, D=3, Q_book=0.5, G=0.2, T=0.0)
    tl = simulate(b, overlap=True)
    assert tl.end == pytest.approx(50 * 3 * MS + 1 * MS + 0.7 * MS, rel=1e-9)
    assert np.allclose(tl.dev_start[1:], tl.dev_end[:-1])  # back to back


def test_overlap_waits_on_the_host_when_it_is_longer():
    # host round 4 ms, device 1 ms: the device idles 3 ms of every 4
    b = batches(50, P_prep=3, D=1, Q_book=1)
    tl = simulate(b, overlap=True)
    assert np.diff(tl.dev_start[1:]) == pytest.approx(np.full(48, 4 * MS))  # the first round collects nothing


def test_a_drained_batch_is_collected_before_the_next_arrival():
    # overlap: batch 1's requests all finish with it; batch 2's arrive 50 ms later. A round
    # that launches nothing collects batch 1 at once; the round launching batch 2 collects nothing
    b = batches(4, P_book=0.1, P_prep=1, D=3, C=0.2, Q_book=0.5, G=0.2, head_Q=0.4, tail_P=0.3)
    b = replace(b, **drains(4, 0.4 * MS, 0.3 * MS, [False, True, False, True]),
                not_before=np.array([0, 0, 50, 50]) * MS)
    tl = simulate(b, overlap=True)
    assert list(tl.launches) == [0, 1, -1, 2, 3, -1] and list(tl.collects) == [-1, 0, 1, -1, 2, 3]
    assert tl.synced[1] == pytest.approx(tl.dev_end[1] + 0.2 * MS)  # not after batch 2's launch
    assert tl.synced[1] < 20 * MS and tl.start[3] == pytest.approx(50 * MS)
    assert tl.launched[2] == pytest.approx(tl.start[2] + 0.3 * MS)  # the draining round's intake
    assert tl.start[4] == pytest.approx(tl.launched[3] + 0.4 * MS)  # the round after it: its hand-off
    assert sum(critical_path(b, tl).values()) == pytest.approx(tl.end, rel=1e-9)


def test_the_fit_collects_mid_run_drains_as_the_trace_did(tmp_path):
    """An open-loop overlap run drains whenever its running requests all finish: the round after
    launches nothing and collects them. The model had every batch collected by the next launch,
    so a request's last tokens waited for the next arrival (87 ms in a 6-request trace at 4/s;
    its ITL p90 fit 2.36 ms against 2.16 measured, now 2.16)."""
    out = tmp_path / "t"
    # the seeded arrivals come 12-336 ms apart at 2/s; a request of 8-16 tokens takes ~20 ms here
    p = mstrace("run", "--model", "tiny", "--requests", "6", "--rate", "2", "--output-len", "8-16",
                "--mode", "overlap", "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    run = load(out)
    mid = np.flatnonzero(run.batches.drained[:-1])
    assert len(mid) >= 2
    b, tl = replayed(run, measured(run.trace.meta)[0], True)
    assert tl.rounds == len(run.steps)  # every round: those that launched nothing too
    steps = run.trace.table("steps", ["step", "collect_ns"]).to_pydict()
    collect = dict(zip(steps["step"], steps["collect_ns"], strict=True))
    err = tl.synced + run.t0 - np.array([collect[int(s)] for s in run.collect_round])
    # a drained batch's collect is replayed as the batch before's was: the replay's drift over a
    # busy stretch (3-5 ms beside a CI run) carries over, the next arrival's wait does not
    assert np.all(np.abs(err[mid] - err[mid - 1]) < 5 * MS), err[mid] - err[mid - 1]


def test_sharing_stretches_the_device_and_the_host_beside_it():
    # device 3 ms, host 1.7 ms a round beside it (batch_prepare 1, the rest 0.7)
    b = batches(50, P_prep=1, D=3, Q_book=0.5, G=0.2)

    def per_batch(s: Sharing) -> tuple[Batches, np.ndarray]:
        x = shared(b, s)
        return x, np.diff(simulate(x, overlap=True).dev_end[2:-2])

    assert per_batch(Sharing())[1] == pytest.approx(np.full(45, 3 * MS))
    # --contention 1 (one core for both): the device takes the host's work on top of its own,
    # and overlap gains nothing over the sum; 0.5: half of it; the host keeps its speed
    one, t = per_batch(Sharing.contention(1.0))
    assert t == pytest.approx(np.full(45, 4.7 * MS)) and one.P_prep == pytest.approx(b.P_prep)
    assert per_batch(Sharing.contention(0.5))[1] == pytest.approx(np.full(45, 3.85 * MS))
    # both at half speed while both work: the host's 1.7 ms take 3.4, in which the device does
    # 1.7 of its 3, then the rest alone: 4.7 a batch; the host's components doubled
    both, t = per_batch(Sharing(Rates(0.5, 0.5), Rates(0.5, 0.5)))
    assert t == pytest.approx(np.full(45, 4.7 * MS))
    assert both.P_prep[1:] == pytest.approx(2 * b.P_prep[1:]) and both.G[:-1] == pytest.approx(2 * b.G[:-1])
    # a GIL's two kinds: pure Python (0.7 ms) stops the device and keeps its own speed; the
    # prepare (1 ms) runs both at 0.4: 2.5 ms in which the device does 1, then 2 alone
    gil, t = per_batch(Sharing(prepare=Rates(0.4, 0.4), python=Rates(0.0, 1.0)))
    assert t == pytest.approx(np.full(45, (0.7 + 2.5 + 2) * MS))
    assert gil.P_prep[1:] == pytest.approx(2.5 * b.P_prep[1:]) and gil.G[:-1] == pytest.approx(b.G[:-1])
    # a short device, done within the host's work: it ends first, and the host's rest runs alone
    fast = shared(batches(50, P_prep=4, D=1), Sharing(Rates(0.5, 0.5), Rates(0.5, 0.5)))
    assert fast.D[:-1] == pytest.approx(np.full(49, 2 * MS))  # 1 ms of work at half speed (the last: none beside)
    assert fast.P_prep[1:] == pytest.approx(np.full(49, 5 * MS))  # 2 ms at half speed, then 3 alone


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 10), st.lists(st.floats(0, 1), min_size=4, max_size=4), st.data())
def test_an_overlap_trace_is_unshared_back_to_each_sides_work_alone(n, r, data):
    """`unshared` inverts `shared`: an overlap trace's fit replays it as it ran."""
    comp = st.floats(0, 5, allow_nan=False)
    arr = {c: np.array(data.draw(st.lists(comp, min_size=n, max_size=n))) * MS for c in COMPONENTS}
    b = Batches(**arr, not_before=np.zeros(n), **random_drains(data, n))
    s = Sharing(Rates(r[0], max(r[1], 0.05)), Rates(r[2], max(r[3], 0.05)))
    back = unshared(shared(b, s), s)
    for c in (*COMPONENTS, "head", "tail_P"):
        assert np.allclose(getattr(back, c), getattr(b, c), rtol=1e-6, atol=1e-3), c


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 12), st.booleans(), st.data())
def test_the_critical_path_is_the_whole_run(n, overlap, data):
    """Whatever the durations, the critical path walked back from the end adds up to the run's
    length: every nanosecond of the run is on it exactly once."""
    comp = st.floats(0, 5, allow_nan=False)
    arr = {c: np.array(data.draw(st.lists(comp, min_size=n, max_size=n))) * MS for c in COMPONENTS}
    t = np.array(data.draw(st.lists(st.floats(-1, 1), min_size=n, max_size=n))) * MS
    arr["T"] = np.maximum(t, -np.concatenate([[0.0], arr["D"][:-1]]))  # as load() bounds it
    arrivals = np.sort(np.array(data.draw(st.lists(st.floats(0, 30), min_size=n, max_size=n)))) * MS
    b = Batches(**arr, not_before=arrivals, **random_drains(data, n))
    if overlap:
        b = shared(b, data.draw(st.sampled_from([Sharing(), Sharing.contention(0.3), Sharing(Rates(0.4, 0.5), Rates(0.0, 0.9))])))
    tl = simulate(b, overlap)
    path = critical_path(b, tl)
    assert sum(path.values()) == pytest.approx(tl.end, rel=1e-9, abs=1.0)
    assert all(v >= -1e-6 for v in path.values())


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 10), st.booleans(), st.sampled_from(sorted(SCALES)), st.data())
def test_a_faster_boundary_never_makes_the_run_longer(n, overlap, boundary, data):
    comp = st.floats(0, 5, allow_nan=False)
    arr = {c: np.array(data.draw(st.lists(comp, min_size=n, max_size=n))) * MS for c in COMPONENTS}
    t = np.array(data.draw(st.lists(st.floats(-1, 1), min_size=n, max_size=n))) * MS
    arr["T"] = np.maximum(t, -np.concatenate([[0.0], arr["D"][:-1]]))
    b = Batches(**arr, not_before=np.zeros(n), **drains(n, drained=data.draw(st.lists(st.booleans(), min_size=n, max_size=n))))
    # (a host slowed too is left out: where the host's parts cost the device differently, a
    # shorter part can bring a costlier one forward, and the device's span grows; docs/whatif.md)
    s = data.draw(st.sampled_from([Sharing(), Sharing.contention(0.3)]))

    def end(x: Batches) -> float:
        return simulate(shared(x, s) if overlap else x, overlap).end

    slow = end(b)
    assert end(b.sped_up(boundary, 0.5, None)) <= slow + 1e-3
    assert end(b.sped_up(boundary, None, -1 * MS)) <= slow + 1e-3


def test_a_speedup_scales_its_components_only():
    b = batches(4, P_book=1, Q_book=3, D=2)
    s = b.sped_up("bookkeeping", None, -2 * MS)  # shared 1:3 between the two bookkeeping rows
    assert s.P_book == pytest.approx(np.full(4, 0.5 * MS)) and s.Q_book == pytest.approx(np.full(4, 1.5 * MS))
    assert s.D is b.D
    assert b.sped_up("device_compute", 0.5, None).D == pytest.approx(np.full(4, 1 * MS))


def test_a_change_to_the_barrier_goes_to_both_inputs_of_each_max():
    """L or T, then C or W: +1 ms on the barrier lengthens each serial round by 1 ms (shared
    four ways it added 0.63 ms: half went to the inputs the max() did not take)."""
    b = batches(10, P_prep=1, L=0.2, T=0.05, D=3, C=0.3, W=0.1, Q_book=0.5)
    base = simulate(b, overlap=False).end
    assert simulate(b.sped_up("scheduler_barrier", None, 1 * MS), overlap=False).end == pytest.approx(base + 10 * MS)


def test_a_launch_never_starts_the_device_before_its_prepare_began():
    """L < 0 (the device started before the prepare row's end) is kept, down to -P_prep: a
    faster prepare cannot start the device before the round (a serial trace's negative L was
    clamped to 0, and its replay ran long by their sum)."""
    b = batches(4, P_book=0.5, P_prep=1, L=-0.4, D=2)
    assert b.sped_up("batch_prepare", 0.25, None).L == pytest.approx(np.full(4, -0.25 * MS))
    tl = simulate(b.sped_up("batch_prepare", 0.0, None), overlap=False)
    assert np.all(tl.dev_start >= tl.start + 0.5 * MS - 1e-3)


@pytest.mark.parametrize("spec", ["nope=1", "device_compute", "device_compute=-1", "device_compute=fast",
                                  "device_compute=inf", "batch_prepare=2s", "device_compute=nanms",
                                  "device_compute=-infms", "device_compute=nan"])
def test_bad_speedups_are_one_line(spec):
    with pytest.raises(WhatIfError) as e:
        Speedup.parse(spec)
    assert "\n" not in str(e.value)


def test_good_speedups_parse():
    assert Speedup.parse("device_compute=0.8") == Speedup("device_compute", factor=0.8)
    assert Speedup.parse("batch_prepare=-0.5ms") == Speedup("batch_prepare", delta_ms=-0.5)


@pytest.mark.parametrize("sample", ["sample-serial", "sample-overlap"])
def test_the_fit_replays_the_sample_as_it_ran(sample):
    """Replayed in its own mode, the model reproduces the trace's own numbers: the components
    are cut so that they add up to the rounds (1%: the fit's only freedom is L/T where the
    trace saw just one of them)."""
    r = whatif(SAMPLES / sample)
    for name in ("cycle_ms", "output_tok_per_s", "ttft_ms_p50", "itl_ms_p50", "itl_ms_p90"):
        assert getattr(r.replayed, name) == pytest.approx(getattr(r.measured, name), rel=0.01), name
    assert r.predicted == r.replayed  # nothing asked: the prediction is the fit
    lo, hi = r.predicted_low, r.predicted_high
    assert lo.cycle_ms <= r.predicted.cycle_ms <= hi.cycle_ms


@pytest.mark.parametrize("sample", ["sample-serial", "sample-overlap"])
def test_a_change_of_nothing_predicts_no_change(sample):
    """A speedup of 1 is a prediction that changes something in form only: it and the fit it
    is shown against find their cold starts the same way, so it equals the fit."""
    r = whatif(SAMPLES / sample, speedups=[Speedup.parse("batch_prepare=1")])
    assert r.predicted == r.replayed


def test_the_first_batchs_hand_over_is_no_guess_for_the_others():
    """An overlap run's device is busy at nearly every launch: when only its first batch (launched
    on a device idle since start-up) or a few were held by their launch, the others' hand-over L
    is the device's turn T, not those samples (and never negative, though a split trace's T
    is); a serial run's T is its launches' L."""
    from viewer.analysis.whatif_fit import MIN_SEEN, _hand_over_guesses

    n = 50
    L_seen, T_seen = np.full(n, 2.0), np.full(n, 0.05)
    L_seen[0], T_seen[0] = 1.1, np.inf  # the first batch: nothing ran before it
    by_launch = np.zeros(n, dtype=bool)
    by_launch[0] = True
    assert _hand_over_guesses(L_seen, T_seen, by_launch) == pytest.approx((0.05, 0.05))
    # a few batches held by their launch are no estimate beside many held by the device ...
    by_launch[1:4] = True
    assert _hand_over_guesses(L_seen, T_seen, by_launch) == pytest.approx((0.05, 0.05))
    # ... MIN_SEEN are: each its own median
    by_launch[1:1 + MIN_SEEN] = True
    assert _hand_over_guesses(L_seen, T_seen, by_launch) == \
        pytest.approx((float(np.median(L_seen[1:1 + MIN_SEEN])), 0.05))
    # a split trace's turns, mostly negative (prefills begun beside the batch before): a
    # borrowed hand-over is not
    by_launch[1:] = False
    assert _hand_over_guesses(L_seen, np.full(n, -6.6), by_launch) == pytest.approx((0.0, -6.6))
    # serial: every batch held by its launch, its T the launches' median (the first's left out)
    L_seen[1:], T_seen[1:] = np.linspace(0.04, 0.08, n - 1), 9.0
    assert _hand_over_guesses(L_seen, T_seen, np.ones(n, dtype=bool)) == pytest.approx((0.06, 0.06))
    # a short trace: one sample each, each its own
    three = np.array([True, True, False])
    assert _hand_over_guesses(np.array([1.1, 0.3, 9.0]), np.array([np.inf, 9.0, 0.2]), three) == \
        pytest.approx((0.3, 0.2))


def test_an_overlap_trace_replays_as_it_ran_whatever_the_rates():
    """Host and device slowing each other are taken out of an overlap trace and put back the
    same way: the fit does not depend on the rates."""
    free = whatif(SAMPLES / "sample-overlap")
    for k in (0.3, 1.0):
        r = whatif(SAMPLES / "sample-overlap", contention=k)
        assert r.replayed.cycle_ms == pytest.approx(free.replayed.cycle_ms, rel=1e-6)
        assert r.replayed.output_tok_per_s == pytest.approx(free.replayed.output_tok_per_s, rel=1e-6)
        # ... while what it predicts for serial does depend on them
        assert whatif(SAMPLES / "sample-overlap", "serial", contention=k).predicted.cycle_ms < \
            whatif(SAMPLES / "sample-overlap", "serial").predicted.cycle_ms


def test_overlap_from_serial_beats_serial_and_says_why():
    r = whatif(SAMPLES / "sample-serial", "overlap")
    assert r.predicted.cycle_ms < r.replayed.cycle_ms
    on_path = {row.boundary: row for row in r.critical_path}
    # the sample's device computes most of each round: overlap leaves it on the path and the
    # host's prepare mostly off it
    assert on_path["device_compute"].on_path_ms_per_round > 0.9 * on_path["device_compute"].ms_per_round
    assert on_path["batch_prepare"].slack_ms_per_round > 0
    serial = whatif(SAMPLES / "sample-serial")
    assert serial.host_bound_batches == serial.batches  # serial: the device waits for every launch


def test_cli_text_and_json():
    rc, out, err = cli("whatif", str(SAMPLES / "sample-serial"), "--mode", "overlap", "--speedup",
                       "batch_prepare=0.5")
    assert rc == 0, err
    assert "predicted with --mode overlap, batch_prepare=0.5" in out and "critical path" in out
    rc, out, err = cli("whatif", str(SAMPLES / "sample-overlap"), "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["mode"] == d["target_mode"] == "overlap" and d["status"]["state"] == "complete"


def test_against_puts_the_run_predicted_beside_the_prediction(tmp_path):
    rc, out, err = cli("whatif", str(SAMPLES / "sample-serial"), "--mode", "overlap", "--against",
                       str(SAMPLES / "sample-overlap"), "--json")
    assert rc == 0, err
    d = json.loads(out)
    c, other = d["against"], whatif(SAMPLES / "sample-overlap")
    assert c["mode"] == "overlap" and c["figures_checked"] == 6
    assert c["measured"].keys() == d["predicted"].keys() and c["measured"]["cycle_ms"] == other.measured.cycle_ms
    for k, m in c["measured"].items():
        p, lo, hi = d["predicted"][k], d["predicted_low"][k], d["predicted_high"][k]
        assert c["error_pct"][k] == pytest.approx(100 * (p / m - 1))
        assert c["inside_interval"][k] == (lo <= m <= hi)
    assert c["figures_inside"] == sum(c["inside_interval"].values())
    rc, out, err = cli("whatif", str(SAMPLES / "sample-serial"), "--mode", "overlap", "--against",
                       str(SAMPLES / "sample-overlap"))
    assert rc == 0 and "against " in out and f"{c['figures_inside']} of 6 measured figures inside" in out, err
    assert "against" not in json.loads(cli("whatif", str(SAMPLES / "sample-serial"), "--json")[1])
    # copies of the overlap run, one thing changed in each
    def changed(name: str, edit) -> Path:
        out = tmp_path / name
        shutil.copytree(SAMPLES / "sample-overlap", out)
        meta = json.loads((out / "meta.json").read_text())
        edit(meta)
        (out / "meta.json").write_text(json.dumps(meta))
        return out

    workload = changed("workload", lambda m: m["workload"].update(digest="0" * 64))
    streams = changed("streams", lambda m: m["config"].update(split_streams=False))
    model = changed("model", lambda m: m["model"].update(dtype="bfloat16"))
    moved_model = changed("moved", lambda m: m["model"].update(path="/elsewhere/tiny"))  # the same model
    backend = changed("backend", lambda m: m["config"].update(cpu_device="thread"))
    rc, _, err = cli("whatif", str(SAMPLES / "sample-serial"), "--mode", "overlap", "--against", str(moved_model))
    assert rc == 0, err
    # the weight pack: refused where both traces record it and it differs; the samples predate it
    packed = changed("packed", lambda m: m["model"].update(weight_pack=True))
    rc, _, err = cli("whatif", str(SAMPLES / "sample-serial"), "--mode", "overlap", "--against", str(packed))
    assert rc == 0, err
    unpacked = tmp_path / "unpacked"
    shutil.copytree(SAMPLES / "sample-serial", unpacked)
    meta = json.loads((unpacked / "meta.json").read_text())
    meta["model"]["weight_pack"] = False
    (unpacked / "meta.json").write_text(json.dumps(meta))
    rc, _, err = cli("whatif", str(unpacked), "--mode", "overlap", "--against", str(packed))
    assert rc == 2 and "ran another model (weight_pack True against False)" in err, err
    for against, args, msg in ((workload, ["--mode", "overlap"], "ran another workload"),
                               (streams, ["--mode", "overlap"], "ran with split streams off; this prediction has "
                                                                "them on"),
                               (model, ["--mode", "overlap"], "ran another model (dtype bfloat16 against float32)"),
                               (backend, ["--mode", "overlap"], "ran another device backend (cpu_device thread "
                                                                "against process)"),
                               (SAMPLES / "sample-overlap", ["--comm-overlap", "maybe"], "must be on or off"),
                               (SAMPLES / "sample-overlap", [], "ran in overlap mode; this prediction is of serial"),
                               (SAMPLES / "sample-serial", ["--speedup", "batch_prepare=0.5"],
                                "is the trace the prediction is made from"),
                               (SAMPLES / "sample-deadlock", [], "not a complete run"),
                               (tmp_path / "nowhere", [], "not found")):
        rc, _, err = cli("whatif", str(SAMPLES / "sample-serial"), *args, "--against", str(against))
        assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_against_a_served_run_counts_its_requests(tmp_path):
    """A server's workload is whatever arrived: no digest, so two served traces must at least
    hold as many requests."""
    a, b = tmp_path / "a", tmp_path / "b"
    for out, n, mode in ((a, "6", "serial"), (b, "5", "overlap")):
        p = mstrace("run", "--model", "tiny", "--requests", n, "--output-len", "4-8", "--mode", mode, "-q",
                    "--out", str(out))
        assert p.returncode == 0, p.stderr
        meta = json.loads((out / "meta.json").read_text())
        meta["workload"].update(digest=None, source="serve:127.0.0.1:8000")
        (out / "meta.json").write_text(json.dumps(meta))
    rc, _, err = cli("whatif", str(a), "--mode", "overlap", "--against", str(b))
    assert rc == 2 and "holds 5 requests and this trace 6: not the same workload" in err, err


@pytest.mark.parametrize("args,msg", [
    (["--mode", "timeslice"], "--mode timeslice"),
    (["--mode", "fast"], "--mode must be one of"),
    (["--speedup", "x=1"], "--speedup takes"),
])
def test_cli_refuses_in_one_line(args, msg):
    rc, out, err = cli("whatif", str(SAMPLES / "sample-serial"), *args)
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_a_trace_of_more_rounds_than_the_model_takes_is_refused_before_its_probes_are_read(monkeypatch):
    """big10m's 1.34 M rounds took 22 minutes and 6-7 GB: one line instead."""
    import viewer.analysis.whatif as w
    import viewer.analysis.whatif_fit as fit

    monkeypatch.setattr(w, "MAX_ROUNDS", 5)
    monkeypatch.setattr(fit, "_rows", lambda tr: pytest.fail("the probe rows were read"))
    rc, _, err = cli("whatif", str(SAMPLES / "sample-serial"))
    assert rc == 2 and "rounds; the model replays each round" in err and "at most 5:" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_an_imported_trace_is_refused(tmp_path):
    out = tmp_path / "imported"
    p = mstrace("import", str(REPO / "tests" / "data" / "kineto" / "hta_nccl_data.json.gz"), "--out", str(out))
    assert p.returncode == 0, p.stderr
    rc, _, err = cli("whatif", str(out))
    assert rc == 2 and "imported profiler trace" in err


# The truth harness: a run with a known delay D at one place, and one without. Predicting
# each from the other by removing (adding) D at that boundary must land within 10% of D of
# the other run's measured cycle, plus however far the model's other inputs moved between
# the two runs. D is what the engine actually held per batch (meta.json), and long against
# a round (50 ms against 3-6 ms). The model's premise is that the delay changes nothing else;
# on a loaded machine it does: beside a CPU hog a process that sleeps 50 ms a round wakes to
# cold caches and a queue for the core, and the held run's device compute, prepare and
# wake-up latency measured 1.5-3x the unheld run's (ci36). That movement is the runs', not
# the model's, so it is added to the tolerance (the sum over the other measured components
# of their per-round change; `idle`, the model's own output, is not one); a pair whose other
# components moved by a quarter of D or more tells too little and counts as a miss, so the
# tolerance never passes 0.35 D, against the ~1 D of a model that ignored the speedup. A
# missed pair is run again, at most twice (3 pairs in all).
DELAY_MS = 50.0
TOL = 0.10
TRIES = 3
COMMON = ["run", "--model", "tiny", "--requests", "16", "--prompt-len", "32-32", "--output-len", "24-24",
          "--shared-prefix", "0", "-q"]


@pytest.mark.parametrize("mode,place,boundary", [("serial", "batch_prepare", "batch_prepare"),
                                                 ("overlap", "between_rounds", "unattributed")])
def test_a_virtual_speedup_predicts_the_run_without_the_delay(tmp_path, mode, place, boundary):
    from tracing.reader import Trace

    errors = []
    for i in range(TRIES):
        base, held = tmp_path / f"base{i}", tmp_path / f"held{i}"
        for out, extra in ((base, []), (held, ["--debug-delay-ms", f"{place}={DELAY_MS}"])):
            p = mstrace(*COMMON, "--mode", mode, "--out", str(out), *extra)
            assert p.returncode == 0, p.stderr
        b, h = whatif(base), whatif(held)
        d = Trace.open(held).meta["debug_delays"][place]["held_ns"] / 1e6 / h.batches
        down = whatif(held, speedups=[Speedup.parse(f"{boundary}=-{d}ms")])
        up = whatif(base, speedups=[Speedup.parse(f"{boundary}=+{d}ms")])
        errors = [(down.predicted.cycle_ms - b.measured.cycle_ms) / d, (up.predicted.cycle_ms - h.measured.cycle_ms) / d]
        moved = _moved_ms(b, h, boundary) / d
        if moved < 0.25 and all(abs(e) <= TOL + moved for e in errors):
            return
    pytest.fail(f"{mode} {place}: predicted cycle off by {errors[0]:+.2f} D (without the delay) and "
                f"{errors[1]:+.2f} D (with it), the other components moved {moved:.2f} D, after {TRIES} pairs")


def _moved_ms(a, b, boundary: str) -> float:
    """How far the model's measured inputs other than `boundary` moved between two runs, ms per round."""
    ma = {p.boundary: p.ms_per_round for p in a.critical_path}
    mb = {p.boundary: p.ms_per_round for p in b.critical_path}
    return sum(abs(ma.get(k, 0.0) - mb.get(k, 0.0)) for k in ma.keys() | mb.keys() if k not in (boundary, IDLE))


# ----------------------------------------------------------------------------- TP and PP traces

# --dtype and --weight-pack given: --against compares both, and auto's measurement on a
# loaded machine could pick differently for two of the three runs
TP_RUN = ["run", "--model", "tiny", "--requests", "24", "--prompt-len", "16-96", "--output-len", "8-24",
          "--seed", "0", "--dtype", "float32", "--weight-pack", "off", "-q"]


@pytest.fixture(scope="module")
def parallel_traces(tmp_path_factory):
    """Three small runs: TP2 with comm overlap off and on, and PP2."""
    root = tmp_path_factory.mktemp("parallel")
    out = {}
    for name, extra in (("tp_off", ["--tp", "2", "--comm-overlap", "off"]), ("tp_on", ["--tp", "2"]),
                        ("pp", ["--pp", "2"])):
        out[name] = root / name
        p = mstrace(*TP_RUN, "--out", str(out[name]), *extra)
        assert p.returncode == 0, p.stderr
    return out


@pytest.mark.parametrize("name", ["tp_off", "tp_on", "pp"])
def test_the_fit_replays_a_parallel_trace(parallel_traces, name):
    """A batch's device work spans its ranks; the model replays TP and PP runs as it does one rank's."""
    r = whatif(parallel_traces[name])
    for field in ("cycle_ms", "output_tok_per_s", "itl_ms_p50"):
        assert getattr(r.replayed, field) == pytest.approx(getattr(r.measured, field), rel=0.01), field
    bounds = {row.boundary for row in r.critical_path}
    assert ("all_reduce" in bounds) == name.startswith("tp")
    assert r.comm_overlap == {"tp_off": "off", "tp_on": "on", "pp": None}[name]


def test_free_all_reduces_take_their_exposed_wait_off_the_cycle(parallel_traces):
    r = whatif(parallel_traces["tp_off"], speedups=[Speedup.parse("all_reduce=0")])
    ar = {row.boundary: row for row in r.critical_path}
    fit = whatif(parallel_traces["tp_off"])
    exposed = {row.boundary: row for row in fit.critical_path}["all_reduce"].ms_per_round
    assert "all_reduce" not in ar and exposed > 0
    # serial: every batch's exposed wait was on the path, so the cycle falls by all of it
    assert fit.predicted.cycle_ms - r.predicted.cycle_ms == pytest.approx(exposed, rel=0.02)


@pytest.mark.parametrize("trace,to", [("tp_off", "on"), ("tp_on", "off")])
def test_comm_overlap_is_predicted_from_the_other_setting(parallel_traces, trace, to):
    r = whatif(parallel_traces[trace], comm_overlap=to)
    assert r.target_comm_overlap == to and r.comm_overlap != to
    assert r.predicted != r.replayed
    rc, out, err = cli("whatif", str(parallel_traces[trace]), "--comm-overlap", to)
    assert rc == 0 and f"predicted with --comm-overlap {to}" in out, err
    assert "gloo's all-reduces run on threads" in " ".join(out.split())  # the CPU emulation's caveat


def test_comm_overlap_is_predicted_for_a_window_from_its_own_collectives(parallel_traces):
    """A window reads the collectives that reach it (their row groups by issue and end time)."""
    from tracing.reader import Trace
    from viewer.export.window import parse_window

    root = parallel_traces["tp_off"]
    steps = np.sort(Trace.open(root).table("steps", ["step"])["step"].to_numpy())
    w = parse_window(Trace.open(root), f"{steps[0]}-{steps[3 * len(steps) // 4]}")  # (all arrive at once)
    whole, part = whatif(root, comm_overlap="on"), whatif(root, comm_overlap="on", window=w)
    assert part.window is not None and part.batches < whole.batches
    fit = {row.boundary: row.ms_per_round for row in whatif(root, window=w).critical_path}
    on = {row.boundary: row.ms_per_round for row in part.critical_path}
    assert fit["all_reduce"] > 0 and on.get("all_reduce", 0.0) < fit["all_reduce"]


@pytest.mark.parametrize("trace,args,msg", [
    ("pp", ["--comm-overlap", "on"], "a TP trace with one pipeline stage"),
    ("tp_off", ["--comm-overlap", "maybe"], "--comm-overlap must be on or off"),
    ("tp_off", ["--mode", "overlap"], "never overlapped"),
    ("pp", ["--mode", "overlap"], "never overlapped"),
])
def test_comm_overlap_refuses_in_one_line(parallel_traces, trace, args, msg):
    rc, _, err = cli("whatif", str(parallel_traces[trace]), *args)
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_against_a_parallel_run_needs_its_layout_and_comm_setting(parallel_traces):
    off, on, pp = (str(parallel_traces[k]) for k in ("tp_off", "tp_on", "pp"))
    rc, out, err = cli("whatif", off, "--comm-overlap", "on", "--against", on, "--json")
    assert rc == 0 and json.loads(out)["against"]["figures_checked"] > 0, err
    # rank 0's forwards wait for the other ranks off its CPU clock: no device-thread times
    from tracing.reader import Trace

    assert all("device_stream_times" not in Trace.open(t).meta["run"] for t in (off, on, pp))
    for args, msg in ((["--against", on], "ran with --comm-overlap on; this prediction has --comm-overlap off"),
                      (["--against", pp], "ran with tp 1, pp 2; this trace with tp 2, pp 1")):
        rc, _, err = cli("whatif", off, *args)
        assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def _split_events(a, b, lat_a, lat_b, tail, k_share=0.0):
    """Rank 0's collectives of one batch run split, in the engine's order (scheduler/parallel/tp.py):
    issue, completion and exposed wait of A's and B's collective of each op, interleaved. A
    segment begun while the other half's collective is in flight is charged `k_share` of the
    overlap (a core shared with the transport)."""
    t = done_a = done_b = 0.0
    issue, end, wait = [], [], []
    for k in range(len(a)):
        if k:
            wait[-2] = max(done_a - t, 0.0)
            t = max(t, done_a)
        t += a[k] + k_share * min(a[k], max(done_b - t, 0.0)) if k else a[k]
        done_a = t + lat_a[k]
        issue.append(t), end.append(done_a), wait.append(0.0)
        if k:
            wait[-2] = max(done_b - t, 0.0)
            t = max(t, done_b)
        t += b[k] + k_share * min(b[k], max(done_a - t, 0.0))
        done_b = t + lat_b[k]
        issue.append(t), end.append(done_b), wait.append(0.0)
    wait[-2] = max(done_a - t, 0.0)
    t = max(t, done_a)
    wait[-1] = max(done_b - t, 0.0)
    t = max(t, done_b) + tail
    return np.array(issue), np.array(end), np.array(wait), t


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.data())
def test_split_batches_are_cut_back_into_their_segments(k, m, data):
    """The segments read off split batches' collectives (m batches side by side) are the
    compute and latencies that made them, and the model's schedule replays each batch's span."""
    from viewer.analysis.whatif_comm import overlapped_span, segments

    ms = st.floats(0.01, 5, allow_nan=False)
    share = data.draw(st.sampled_from([0.0, 0.5, 1.0]))
    parts = [tuple(np.array(data.draw(st.lists(ms, min_size=k, max_size=k))) for _ in range(4)) for _ in range(m)]
    a, b, la, lb = (np.stack([p[i] for p in parts]) for i in range(4))
    tail, head = (np.array(data.draw(st.lists(ms, min_size=m, max_size=m))) for _ in range(2))  # head: the broadcast
    events = [_split_events(*p, t, share) for p, t in zip(parts, tail, strict=True)]
    issue, end, wait, stop = (np.stack([e[i] for e in events]) for i in range(4))
    s = segments(issue + head[:, None], end + head[:, None], wait, np.ones((m, 2 * k)), True, np.zeros(m),
                 stop + head, head)
    assert s.split and s.alone(share) == pytest.approx(np.stack([a, b], axis=-1))
    assert s.latency == pytest.approx(np.stack([la, lb], axis=-1))
    assert s.tail == pytest.approx(tail) and np.array_equal(s.head, head)
    assert overlapped_span(a, b, la, lb, tail, head, share) == pytest.approx(stop + head)
    # with nothing to wait for, splitting moves no time: the span is the work
    f = data.draw(st.floats(0.1, 0.9))
    c, zero = a + b, np.zeros((m, k))
    assert overlapped_span(f * c, (1 - f) * c, zero, zero, tail, head) == pytest.approx(c.sum(axis=1) + tail + head)


def test_a_synchronous_batch_is_cut_into_its_segments():
    from viewer.analysis.whatif_comm import segments

    c, lat = np.array([1.0, 2.0, 0.5]), np.array([0.3, 0.4, 0.2])
    issue = 10 + np.cumsum(c) + np.concatenate([[0], np.cumsum(lat)[:-1]])
    s = segments((issue + 0.4)[None], (issue + lat + 0.4)[None], lat[None], np.full((1, 3), 64.0), False,
                 np.array([10.0]), np.array([issue[-1] + lat[-1] + 1.1]), np.array([0.4]))
    assert not s.split and s.compute[0] == pytest.approx(c) and s.latency[0] == pytest.approx(lat)
    assert s.tail == pytest.approx([0.7])


def test_the_per_op_fit_finds_the_fixed_part():
    """Halving a batch halves only the part of each op that grows with its rows."""
    from viewer.analysis.whatif_comm import Segments, fit_ops

    n = np.array([64.0, 640.0, 6400.0, 3200.0])[:, None]
    zeros = np.zeros(4)
    four = Segments(False, np.column_stack([0.5 + 1e-3 * n, 0.2 + 2e-3 * n]), np.column_stack([n, n]),
                    np.zeros((4, 2)), zeros, zeros)
    assert fit_ops([four]) == pytest.approx(np.array([[0.5, 1e-3], [0.2, 2e-3]]))
    same = Segments(False, np.full((3, 1), 2.0), np.full((3, 1), 100.0), np.zeros((3, 1)), np.zeros(3), np.zeros(3))
    assert fit_ops([same]) == pytest.approx(np.array([[0.0, 0.02]]))  # one size: proportional


@pytest.mark.parametrize("decode,prefills,length", [(0, 1, 40), (1, 0, 0), (2, 0, 0), (7, 0, 0), (0, 2, 30),
                                                     (3, 1, 100), (60, 1, 20), (5, 3, 16), (1, 1, 1)])
def test_split_share_cuts_where_the_runner_does(decode, prefills, length):
    from types import SimpleNamespace

    from scheduler.parallel.tp import split_row
    from viewer.analysis.whatif_comm import split_share

    tokens = decode + prefills * length
    batch = SimpleNamespace(num_seqs=decode + prefills, num_decode=decode, num_tokens=tokens,
                            prefills=[SimpleNamespace(row_start=decode + j * length) for j in range(prefills)])
    row = split_row(batch)
    f = split_share(decode, prefills, prefills * length)
    assert (f is None) == (row is None)
    if row is not None:
        assert f * tokens == pytest.approx(row)


def test_the_report_of_a_tp_trace_predicts_the_other_comm_setting_not_overlap_mode(parallel_traces):
    """TP and PP run serial or time-slice only: the report offers what they can switch."""
    from viewer.analysis.report import build_report
    from viewer.analysis.whatif_gains import COMM_OVERLAP, OVERLAP, cycle_gains

    gains = cycle_gains(parallel_traces["tp_off"], ["all_reduce"], "serial")
    assert COMM_OVERLAP in gains and OVERLAP not in gains
    assert gains[COMM_OVERLAP] == pytest.approx(whatif(parallel_traces["tp_off"], comm_overlap="on").predicted.cycle_ms
                                                / whatif(parallel_traces["tp_off"]).replayed.cycle_ms - 1, abs=1e-9)
    assert OVERLAP not in cycle_gains(parallel_traces["pp"], [], "serial")
    lines = " ".join(build_report(parallel_traces["tp_off"]).worth_attacking)
    assert "`--mode overlap`" not in lines and "all_reduce" in lines


def test_a_tp_trace_without_collectives_still_reports(parallel_traces, tmp_path):
    """Traces written before the collectives table: the report leaves the prediction out, and
    asking whatif for it is one line."""
    import shutil

    from viewer.analysis.report import build_report

    old = tmp_path / "old"
    shutil.copytree(parallel_traces["tp_off"], old)
    shutil.rmtree(old / "collectives")
    assert build_report(old).worth_attacking
    rc, _, err = cli("whatif", str(old), "--comm-overlap", "on")
    assert rc == 2 and "no collectives table" in err and len(err.strip().splitlines()) == 1, err


def test_the_remedies_fit_what_a_tp_run_can_switch():
    from viewer.analysis.advice import WORTH, _remedy
    from viewer.analysis.whatif_gains import COMM_OVERLAP

    tp = {"tp": 2, "comm_overlap": False}
    assert "--mode overlap" in _remedy("batch_prepare", "serial", {}, {})
    assert "--mode overlap" not in _remedy("batch_prepare", "serial", tp, {})
    assert "--mode overlap" not in _remedy("scheduler_barrier", "serial", {"pp": 2}, {})
    assert "hides it" in _remedy("all_reduce", "serial", tp, {COMM_OVERLAP: -WORTH})
    assert "would not hide it" in _remedy("all_reduce", "serial", tp, {COMM_OVERLAP: WORTH})
    assert "less than 2%" in _remedy("all_reduce", "serial", tp, {COMM_OVERLAP: 0.0})


def test_the_remedy_says_when_overlap_would_not_hide_host_work():
    """A serial trace whose host and device slow each other (a device thread and the GIL, as
    measured at start-up) is not told that overlap would hide its host work."""
    from viewer.analysis.advice import WORTH, _remedy
    from viewer.analysis.whatif_gains import OVERLAP

    assert "runs it under the device's work" in _remedy("batch_prepare", "serial", {}, {OVERLAP: -0.2})
    no = _remedy("bookkeeping", "serial", {}, {OVERLAP: WORTH})
    assert "would not hide it here" in no and "+2.0%" in no
    assert "by less than 2%" in _remedy("bookkeeping", "serial", {}, {OVERLAP: -WORTH / 2})


def test_a_rejected_request_is_in_the_predicted_span_as_in_the_reports(tmp_path):
    """The report's throughput runs over every request row, a rejected one too (it arrived
    0.5 s before the others here); the model's fit must measure the same span, or every
    prediction checked against a run with a rejection is off by it."""
    import json as json_

    from tests.support.cli import mstrace

    wl = tmp_path / "w.jsonl"
    rows = [{"id": "huge", "input_ids": list(range(5, 205)), "max_new_tokens": 2, "arrival_s": 0.0}]
    rows += [{"id": f"r{i}", "input_ids": list(range(5, 14)), "max_new_tokens": 12, "ignore_eos": True,
              "arrival_s": 0.5} for i in range(6)]
    wl.write_text("\n".join(json_.dumps(r) for r in rows) + "\n")
    out = tmp_path / "t"
    assert mstrace("run", "--model", "tiny", "--workload", str(wl), "--kv-blocks", "8", "--out", str(out),
                   "-q").returncode == 0
    r = whatif(out)
    assert r.measured.output_tok_per_s == pytest.approx(r.replayed.output_tok_per_s, rel=0.05)


def test_a_trace_without_probes_is_refused_saying_so(tmp_path):
    out = tmp_path / "np"
    assert mstrace("run", "--model", "tiny", "--requests", "6", "--no-probes", "--out", str(out), "-q").returncode == 0
    rc, _, err = cli("whatif", str(out))
    assert rc == 2 and "recorded with --no-probes" in err and len(err.strip().splitlines()) == 1, err


def test_an_interval_never_reaches_below_zero():
    """Every figure is a time or a rate: a spread wider than the point stops at 0."""
    from viewer.analysis.whatif import _interval

    rng = np.random.default_rng(0)
    own, table = rng.normal(0, 5, (50, 6)), rng.normal(0, 5, (50, 6))
    lo, hi = _interval(own, table, np.full(6, 1.0))
    assert min(lo.array()) >= 0 and min(hi.array()) > 1


@pytest.mark.parametrize("flags", [("--mode", "overlap", "--no-overlap-schedule"),
                                   ("--mode", "serial", "--overlap-schedule")])
def test_the_rounds_are_replayed_as_the_overlap_schedule_ran_them(tmp_path, flags):
    """The model read the rounds' order from --mode alone: --mode overlap --no-overlap-schedule
    was refused as a truncated run, --mode serial --overlap-schedule replayed as serial (cycle
    1.05 ms against 0.80 measured). The fit replays each as it ran: within 10%, a third of the
    bug's error (the sample traces replay within 1%; a fresh split-stream serial run read 4%
    off beside a CI run, its streams' shares measured at start-up, as the code before read it)."""
    out = tmp_path / "t"
    p = mstrace("run", "--model", "tiny", "--requests", "16", *flags, "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    r = whatif(out)
    assert r.mode == ("overlap" if "--overlap-schedule" in flags else "serial")
    assert r.replayed.cycle_ms == pytest.approx(r.measured.cycle_ms, rel=0.10)


def test_a_serial_run_has_no_slack_and_the_barrier_counts_the_inputs_it_took():
    """Serial: every row is on the path. The barrier's row counted both inputs of each max()
    (L and T, C and W), so it showed slack a speedup of it did not have."""
    from viewer.analysis.whatif import _path_table

    b = batches(10, P_prep=1, L=0.2, T=0.5, D=3, C=0.3, W=0.1, Q_book=0.5)
    rows = {r.boundary: r for r in _path_table(b, simulate(b, overlap=False))}
    assert all(r.slack_ms_per_round == pytest.approx(0, abs=1e-9) for r in rows.values())
    assert rows["scheduler_barrier"].ms_per_round == pytest.approx(0.2 + 0.3)
