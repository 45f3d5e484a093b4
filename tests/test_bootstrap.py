"""`diff`'s resampling machinery: circular block draws, the Politis-White block length,
bootstrap p-values and Benjamini-Hochberg."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.diff_synth import ar1
from viewer.analysis import bootstrap as BS


def test_block_resampling_draws_runs_of_consecutive_cycles() -> None:
    rng = np.random.default_rng(0)
    w = BS.resample_weights(100, 500, rng, block=5)
    assert w.shape == (500, 100) and (w.sum(axis=1) == 100).all()
    # circular: every cycle, the first and last included, is drawn once on average
    assert np.abs(w.mean(axis=0) - 1).max() < 0.25 and w[:, 0].mean() == pytest.approx(1, abs=0.25)
    for row in w[:20]:  # drawn cycles come in runs of >= 5 neighbours (around the circle), but for one cut run
        drawn = np.flatnonzero(row)
        runs = np.split(drawn, np.flatnonzero(np.diff(drawn) > 1) + 1)
        if len(runs) > 1 and runs[0][0] == 0 and runs[-1][-1] == 99:  # a run that wraps around
            runs = [np.concatenate([runs[-1], runs[0]]), *runs[1:-1]]
        assert sum(len(r) < 5 for r in runs) <= 1


def test_block_length_grows_with_autocorrelation_as_the_theory_says() -> None:
    """AR(1), coefficient phi: the optimal circular-block length is
    (3/2)^(1/3) (2 phi / (1 - phi^2))^(2/3) n^(1/3) (Politis & White 2004, corrected 2009)."""
    n = 2000
    got = {}
    for phi in (0.0, 0.3, 0.6, 0.9):
        got[phi] = np.median([BS.block_length(ar1(n, phi, np.random.default_rng([s, 7]))) for s in range(12)])
        if phi:
            want = 1.5 ** (1 / 3) * (2 * phi / (1 - phi**2)) ** (2 / 3) * n ** (1 / 3)
            assert 0.7 * want < got[phi] < 1.3 * want, (phi, got[phi], want)
    assert got[0.0] <= 3 < got[0.3] < got[0.6] < got[0.9]  # white noise needs (almost) no blocks


def test_autocovariances_are_the_direct_sums_at_every_lag() -> None:
    """The FFT pads only to n + lags (a 5-smooth length): no lag may pick up a wrapped-around term."""
    rng = np.random.default_rng(3)
    for n, lags in ((97, 96), (1000, 40), (1537, 1536), (4099, 200)):
        e = rng.standard_normal(n)
        e -= e.mean()
        want = np.array([e[: n - k] @ e[k:] for k in range(lags + 1)]) / n
        np.testing.assert_allclose(BS._autocov(e, lags), want, rtol=1e-9, atol=1e-12)
    for at_least in (1, 2, 7, 97, 4097, 1_342_600):
        got = BS._smooth_length(at_least)
        assert got >= at_least and got < 2 * at_least + 1
        m = got
        for d in (2, 3, 5):
            while m % d == 0:
                m //= d
        assert m == 1, got
    assert BS._smooth_length(1_342_600) == 1_350_000  # not the power of two past 2n (4,194,304)


def test_block_length_edge_cases() -> None:
    assert BS.block_length(np.ones(500)) == 1  # no variation: nothing to preserve
    assert BS.block_length(np.arange(5.0)) == 1  # too short to estimate anything
    assert BS.block_length(np.array([1.0, np.nan, 2.0] * 10)) >= 1  # NaNs are dropped
    # a trend (a run's ramp-up) looks like very long memory: long blocks, capped at min(3 sqrt(n), n / 3)
    assert 30 < BS.block_length(np.arange(400.0)) <= 60
    assert BS.block_length(np.arange(60.0)) <= 20
    assert BS.block_length(np.repeat([0.0, 1.0], 500)) > 30  # two regimes of 500 rounds


def test_block_length_beats_cube_root_on_correlated_cycles() -> None:
    """Strongly correlated cycles (AR(1), 0.8): blocks of the chosen length come much closer
    to the true spread of the mean than n^(1/3) (7 for 400), which is about 30% too narrow.
    (Still ~12% narrow: the block bootstrap's small-sample bias, documented in docs/report.md.)"""
    n, phi = 400, 0.8
    means: list[float] = []
    width_pw: list[float] = []
    width_cube: list[float] = []
    for s in range(100):
        x = ar1(n, phi, np.random.default_rng([s, 3]))
        means.append(float(x.mean()))

        def mean(w: np.ndarray, x: np.ndarray = x) -> dict[str, np.ndarray]:
            return {"m": w @ x / n}

        for block, out in ((BS.block_length(x), width_pw), (round(n ** (1 / 3)), width_cube)):
            m = BS.bootstrap(n, 300, np.random.default_rng(s), [(mean, None)], block)[0]["m"]
            out.append(float(np.std(m[1:])))
    true = np.std(means)
    assert np.mean(width_cube) < 0.75 * true  # the old rule (measured 0.71)
    assert 0.82 * true < np.mean(width_pw) < 1.2 * true  # measured 0.88


def test_bootstrap_pairs_and_orders_draws() -> None:
    x = np.arange(6.0)
    cols = np.array([5, 4, 3, 2, 1, 0])  # B's row j is A's item 5 - j
    sa, sb = BS.bootstrap(6, 50, np.random.default_rng(0), [(lambda w: {"w": w}, None), (lambda w: {"w": w}, cols)])
    assert (sa["w"][:, cols] == sb["w"]).all() and (sa["w"][0] == 1).all()
    # order: blocks run along positions, position k holding item order[k]
    order = np.array([3, 0, 4, 1, 5, 2])
    w = BS.bootstrap(6, 200, np.random.default_rng(1), [(lambda w: {"w": w}, None)], block=2, order=order)[0]["w"]
    assert (w.sum(axis=1) == 6).all()
    seq = w[1:, order]  # draw counts in block order: a drawn position's neighbour is drawn too, mostly
    assert ((seq[:, :-1] > 0) & (seq[:, 1:] > 0)).mean() > ((w[1:, :-1] > 0) & (w[1:, 1:] > 0)).mean()
    del x


def test_p_value() -> None:
    rng = np.random.default_rng(0)
    assert BS.p_value(np.zeros(1000)) == 1.0  # a trace against itself, paired
    assert (BS.p_value(rng.normal(0, 1, 1000)) or 0) > 0.5
    assert BS.p_value(rng.normal(2, 1, 1000)) == pytest.approx(0.0455, abs=0.02)  # ~2 sd from 0: count
    far = BS.p_value(rng.normal(6, 1, 1000))  # beyond every resample: a normal tail, below the count's bound
    assert far is not None
    assert 0 < far < 2 / 1001
    assert BS.p_value(np.full(1000, 3.0)) == pytest.approx(2 / 1001)  # no spread: the count's bound
    assert BS.p_value(np.array([np.nan])) is None


def test_benjamini_hochberg() -> None:
    p = np.array([0.01, 0.04, 0.03, 0.005, 0.5])
    adj = BS.bh_adjust(p)
    # sorted 0.005 0.01 0.03 0.04 0.5 -> x m / rank = 0.025 0.025 0.05 0.05 0.5, then running min from the top
    assert adj == pytest.approx([0.025, 0.05, 0.05, 0.025, 0.5])
    assert (BS.bh_adjust([0.04] * 10) == 0.04).all() and len(BS.bh_adjust([])) == 0
    assert (BS.bh_adjust(np.linspace(0.001, 1, 40)) >= np.linspace(0.001, 1, 40)).all()


@pytest.mark.parametrize("block", [1, 7])
def test_draw_counts_are_the_same_a_row_at_a_time(monkeypatch, block):
    """Long rows are counted one at a time: the same counts as all rows in one count."""
    rows = BS.resample_weights(5000, 9, np.random.default_rng(3), block)
    monkeypatch.setattr(BS, "ROW_BINCOUNT", 10**9)
    flat = BS.resample_weights(5000, 9, np.random.default_rng(3), block)
    assert np.array_equal(rows, flat) and rows.dtype == flat.dtype == np.float64
    assert (rows.sum(axis=1) == 5000).all()
