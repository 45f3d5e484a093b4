from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.model import sample


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_are_argmax() -> None:
    logits = torch.randn(5, 50, generator=gen(0))
    out = sample(logits, [0.0] * 5, [1.0] * 5, [None] * 5)
    assert out == logits.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_keep_row_order() -> None:
    logits = torch.full((3, 10), -1e4)
    logits[0, 2] = logits[1, 7] = logits[2, 4] = 0.0  # each row effectively one-hot
    out = sample(logits, [0.0, 1.0, 0.0], [1.0, 0.9, 1.0], [None, gen(1), None])
    assert out == [2, 7, 4]


def test_empty_and_length_mismatch() -> None:
    assert sample(torch.empty(0, 4), [], [], []) == []
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 4), [1.0], [1.0, 1.0], [None, None])


def test_seed_reproducible_and_independent_of_batch() -> None:
    logits = torch.randn(4, 100, generator=gen(2))
    temps, tops = [0.8, 1.3, 0.0, 1.0], [0.9, 1.0, 1.0, 0.5]

    def run() -> list[list[int]]:
        gens = [gen(10), gen(11), None, gen(13)]
        return [sample(logits, temps, tops, gens) for _ in range(20)]

    assert run() == run()
    # Row 1 sampled alone with a fresh generator of the same seed draws the same sequence.
    alone_gen = gen(11)
    alone = [sample(logits[1:2], [1.3], [1.0], [alone_gen])[0] for _ in range(20)]
    gens = [gen(10), gen(11), None, gen(13)]
    batched = [sample(logits, temps, tops, gens)[1] for _ in range(20)]
    assert alone == batched


def _freqs(logits: torch.Tensor, temp: float, top_p: float, n: int, seed: int) -> torch.Tensor:
    g = gen(seed)
    rows = logits.expand(n, -1)
    counts = torch.zeros(logits.shape[-1])
    for tok in sample(rows, [temp] * n, [top_p] * n, [g] * n):
        counts[tok] += 1
    return counts / n


def test_temperature_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    for temp in (0.5, 1.0, 2.0):
        expected = torch.softmax(logits[0] / temp, -1)
        got = _freqs(logits, temp, 1.0, n, seed=int(temp * 10))
        # ~4.5 binomial standard deviations: flaky with probability < 1e-4 (and seeded anyway).
        tol = 4.5 * torch.sqrt(expected * (1 - expected) / n) + 1e-9
        assert torch.all((got - expected).abs() <= tol), (temp, got, expected)


def test_top_p_keeps_smallest_covering_set() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    # Mass before token 2 is 0.8 >= 0.75, so only {0, 1} survive, renormalised 5:3.
    got = _freqs(logits, 1.0, 0.75, 3000, seed=3)
    assert got[2] == 0 and got[3] == 0
    assert abs(got[0].item() - 0.625) < 0.04
    got = _freqs(logits, 1.0, 0.85, 3000, seed=4)
    assert got[2] > 0 and got[3] == 0


def test_tiny_top_p_keeps_top_token() -> None:
    logits = torch.randn(6, 40, generator=gen(5))
    out = sample(logits, [5.0] * 6, [1e-6] * 6, [gen(i) for i in range(6)])
    assert out == logits.argmax(-1).tolist()


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 64),
    seed=st.integers(0, 2**31 - 1),
    temp=st.floats(0.05, 5.0),
    top_p=st.floats(0.01, 1.0),
)
def test_sample_stays_in_nucleus(vocab: int, seed: int, temp: float, top_p: float) -> None:
    logits = torch.randn(1, vocab, generator=gen(seed)) * 3
    tok = sample(logits, [temp], [top_p], [gen(seed + 1)])[0]
    probs = torch.softmax(logits[0] / temp, -1)
    sorted_p, order = probs.sort(descending=True, stable=True)
    before = torch.cumsum(sorted_p, 0) - sorted_p
    keep = {int(order[i]) for i in range(vocab) if i == 0 or top_p >= 1.0 or before[i] < top_p}
    assert tok in keep
    assert not math.isnan(probs.sum().item())


@pytest.mark.parametrize("temp, top_p", [(5e-324, 1.0), (1e-30, 0.5), (0.7, 5e-324), (1e-6, 1e-300)])
def test_extreme_parameters_sample_the_top_token_instead_of_failing(temp: float, top_p: float) -> None:
    """Found by the serve fuzz: a temperature that overflows logits / T to inf made NaN
    probabilities, and a top_p that rounds to 0 in float32 dropped every token."""
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, [temp], [top_p], [g]) == [1]
