"""The RoPE tables (scheduler/model/layers.py, RotaryTable): grown by doubling, the same values
at every size, and one whole pair to every caller while the two streams of split scheduling
grow it from two threads."""

from __future__ import annotations

import threading

import torch

from scheduler.model.layers import RotaryTable


def table(dtype: torch.dtype = torch.bfloat16) -> RotaryTable:
    return RotaryTable(1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), dtype, torch.device("cpu"))


def test_a_grown_table_holds_the_same_rows_and_a_held_pair_stays_as_it_was():
    rope = table()
    cos, sin = rope.tables(10)
    assert cos.shape == sin.shape == (256, 16)
    kept = cos.clone(), sin.clone()
    big_cos, big_sin = rope.tables(1000)
    assert big_cos.shape == big_sin.shape == (1024, 16)
    assert torch.equal(cos, kept[0]) and torch.equal(sin, kept[1])  # the caller's pair is untouched
    assert torch.equal(big_cos[:256], cos) and torch.equal(big_sin[:256], sin)  # the same bits, grown
    assert rope.tables(5)[0] is big_cos  # never swapped for a shorter one
    c, s = rope.lookup(torch.tensor([0, 300, 999]), 1000)
    assert torch.equal(c[:, 0], big_cos[[0, 300, 999]]) and torch.equal(s[:, 0], big_sin[[0, 300, 999]])


def grow_at_once(lengths: list[int]) -> tuple[RotaryTable, list[tuple[int, int, int]]]:
    """One table grown by a thread per length, all let go together: (the table, per thread its
    length asked and the rows of the cos and sin it got)."""
    rope = table()
    got: list[tuple[int, int, int]] = []
    start = threading.Barrier(len(lengths))

    def grow(n: int) -> None:
        start.wait()
        cos, sin = rope.tables(n)
        got.append((n, cos.shape[0], sin.shape[0]))

    threads = [threading.Thread(target=grow, args=(n,)) for n in lengths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rope, got


def test_threads_growing_it_at_once_each_get_a_whole_pair():
    """The contract under threads: each caller gets a whole pair, at least as long as it
    asked. (Before the pair was one tuple, cos and sin were swapped one after the other and a
    thread could read a cos of one growth and a sin of another; the GIL makes that interleaving
    rare, so this test states the contract rather than reproducing the old race.)"""
    lengths = [300, 2000, 600, 5000, 1200, 40, 3000, 900]
    for _ in range(20):
        rope, got = grow_at_once(lengths)
        assert len(got) == len(lengths)
        assert all(c == s >= n for n, c, s in got), got
        assert rope.tables(1)[0].shape[0] == 8192
