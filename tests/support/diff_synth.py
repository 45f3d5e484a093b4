"""Synthetic traces for `diff`'s statistics: a stationary, autocorrelated run of serial rounds.

Every round: the device computes, the scheduling thread waits for it (the barrier),
then bookkeeping, batch_prepare and response_send. Each duration is a base plus
two AR(1) processes with the same coefficient: one shared by all of them (the
batch size drifting, as in a real run) and one of its own. Requests decode for
consecutive rounds, so their token gaps are the rounds' collect-to-collect gaps
and their latencies sums of round lengths, as in the engine. The workload (which
rounds each request spans) comes from its own seed, so two runs of "the same
workload" share request ids and structure and differ only in timing noise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from viewer.analysis.diff import Side

MS = 1e6


def ar1(n: int, phi: float, rng: np.random.Generator) -> np.ndarray:
    """A stationary AR(1) series with unit variance."""
    e = rng.normal(size=n) * np.sqrt(1 - phi**2)
    x = np.empty(n)
    x[0] = rng.normal()
    for t in range(1, n):
        x[t] = phi * x[t - 1] + e[t]
    return x


def run(rounds: int = 400, seed: int = 0, workload: int = 0, phi: float = 0.8, requests: int = 160,
        shift_ms: dict[str, float] | None = None, burst: bool = False, noise: float = 1.0) -> Side:
    """One synthetic trace as `diff` sees it (`tables`)."""
    probes, steps, reqs, meta = tables(rounds, seed, workload, phi, requests, shift_ms, burst, noise)
    return Side.of(probes, steps, reqs, meta=meta)


def tables(rounds: int = 400, seed: int = 0, workload: int = 0, phi: float = 0.8, requests: int = 160,
           shift_ms: dict[str, float] | None = None, burst: bool = False,
           noise: float = 1.0) -> tuple[pa.Table, pa.Table, pa.Table, dict[str, Any]]:
    """One synthetic trace's probes, steps, requests and meta. shift_ms: a constant added to
    a boundary's per-round cost; noise: a factor on every duration's random part."""
    rng = np.random.default_rng([seed, 1])
    shift = {k: v * MS for k, v in (shift_ms or {}).items()}
    common = ar1(rounds, phi, rng)

    def part(name: str, base: float, shared: float, own: float, floor: float) -> np.ndarray:
        x = base + shift.get(name, 0.0) + noise * (shared * common + own * ar1(rounds, phi, rng))
        return np.maximum(x, floor).astype(np.int64)

    dev = part("device_compute", 5 * MS, 0.6 * MS, 0.3 * MS, 1 * MS)
    bk = part("bookkeeping", 2 * MS, 0.2 * MS, 0.3 * MS, 0.05 * MS)
    prep = part("batch_prepare", 0.5 * MS, 0.1 * MS, 0.05 * MS, 0.05 * MS)
    send = part("response_send", 0.1 * MS, 0.0, 0.02 * MS, 0.01 * MS)
    length = dev + bk + prep + send
    start = np.concatenate([[0], np.cumsum(length)[:-1]]) + 10**9
    rows = [(start, dev, "device_compute"), (start, dev, "scheduler_barrier"), (start + dev, bk, "bookkeeping"),
            (start + dev + bk, prep, "batch_prepare"), (start + dev + bk + prep, send, "response_send")]
    probes = pa.table({
        "ts_ns": np.concatenate([r[0] for r in rows]),
        "dur_ns": np.concatenate([r[1] for r in rows]),
        "boundary": pa.array([r[2] for r in rows for _ in range(rounds)]).dictionary_encode(),
        "rank": np.zeros(5 * rounds, np.int32),
    })
    collect = start + dev  # tokens are collected when the device's round is done
    steps = pa.table({"step": np.arange(rounds), "mode": pa.array(["serial"] * rounds).dictionary_encode(),
                      "ts_ns": start, "dur_ns": length, "blocks_used": np.zeros(rounds, np.int32),
                      "collect_ns": collect})
    return (probes, steps, workload_requests(requests, rounds, workload, start, collect, burst),
            {"workload": {"digest": f"w{workload}"}})


def workload_requests(n: int, rounds: int, workload: int, start: np.ndarray, collect: np.ndarray,
                      burst: bool = False) -> pa.Table:
    """n requests: each waits `queue` rounds after arriving, then emits one token per round
    for `out_len` rounds. burst: all arrive at the first round, each starts once the one
    before it has run a few rounds (closed loop)."""
    rng = np.random.default_rng([workload, 2])
    out_len = rng.integers(8, 32, n)
    queue = rng.integers(0, 4, n)
    if burst:
        s0 = np.minimum(np.arange(n) * 2, rounds - 33)
        arrive_round = np.zeros(n, np.int64)
    else:
        s0 = np.sort(rng.integers(4, rounds - 33, n))
        arrive_round = s0 - queue
    tokens = [collect[s: s + k] for s, k in zip(s0, out_len, strict=True)]
    return pa.table({
        "request_id": [f"req-{i}" for i in range(n)],
        "arrival_ns": start[arrive_round] - 1000,
        "first_token_ns": [int(t[0]) for t in tokens],
        "finish_ns": [int(t[-1]) for t in tokens],
        "prompt_len": rng.integers(16, 64, n).astype(np.int32),
        "output_len": out_len.astype(np.int32),
        "dur_itl_ns": pa.array([np.diff(t).tolist() for t in tokens], pa.list_(pa.int64())),
        "token_runs": pa.array([[int(s), int(k)] for s, k in zip(s0, out_len, strict=True)], pa.list_(pa.int64())),
        "finish_reason": ["length"] * n,
        "num_preemptions": np.zeros(n, np.int32),
    })
