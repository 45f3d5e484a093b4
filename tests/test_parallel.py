"""Tensor- and pipeline-parallel execution against transformers as the oracle.

The slow tests spawn real gloo ranks on 127.0.0.1 that greedy-generate with test_model_oracle's
miniature continuous-batching loop (tests/support/oracle.py: chunked prefill, arrivals, batched
decodes, shuffled chunk order and KV blocks); the logits rank's tokens and logit rows must pass the same
teacher-forced check.  The fast tests check the sharding rules with TP ranks simulated by threads.

Module-level imports are kept light on purpose: every spawned rank imports this module to find
its target, and transformers (needed only by the parent, for the oracle) costs seconds per rank.
"""

from __future__ import annotations

import multiprocessing.connection
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from probes.boundaries import ALL_REDUCE, PP_BUBBLE
from probes.waits import WaitTimeout
from scheduler.model.config import ModelConfig, ModelLoadError
from scheduler.model.forward_batch import ForwardBatch, SeqChunk, build_forward_batch
from scheduler.model.kv_cache import PagedKVCache
from scheduler.model.loader import load_model
from scheduler.parallel import (
    AllReduce,
    ParallelState,
    ShardedModel,
    TPRunner,
    destroy,
    init_distributed,
    kv_heads_for_rank,
    slice_batch,
    split_row,
    stage_layers,
    tp_config,
    tp_shard_fn,
)
from scheduler.seeds import late_context
from tests.support import oracle
from tests.support.oracle import BLOCK, Req

# test_model_oracle's workload: lengths straddle blocks and the Mistral window, a 1-token prompt
# goes through the decode path, the 64-chunk one through one-shot prefill.
LENGTHS, CHUNKS, MAX_NEW = [5, 17, 40, 1, 33], [7, 7, 7, 7, 64], 20
RANK_TIMEOUT_S = 20.0  # every collective / p2p wait of a rank
JOB_TIMEOUT_S = 90.0  # the whole spawn, start to join


# ----------------------------------------------------------------------------- the oracle's loop


def oracle_check(
    ckpt: Path, prompts: list[list[int]], out: list[list[int]], logits: list[Any]
) -> None:
    # Parent-side only: load_hf imports transformers, which would cost every rank seconds.
    reqs = []
    for p, o, lg in zip(prompts, out, logits, strict=True):
        r = Req(p, len(p), 0, len(o))
        r.out, r.logits = list(o), list(lg)
        reqs.append(r)
    oracle.teacher_forced_check(oracle.load_hf(ckpt), reqs)


def _builders() -> Any:
    from tests.support import checkpoints

    return checkpoints


# ----------------------------------------------------------------------------- ranks


@dataclass(slots=True)
class Job:
    ckpt: str
    out_dir: str
    init_method: str
    world: int
    tp: int
    pp: int
    overlaps: tuple[bool, ...]
    extras: bool = False  # also measure all-reduce latency and provoke a timed-out wait
    init_timeout_s: float = RANK_TIMEOUT_S
    late_peer_s: float = 0.0  # > 0: only an all-reduce that rank 1 joins this late, no generation


def _rank_main(rank: int, job: Job) -> None:
    """A spawned rank: generate once per overlap mode, save what the parent checks."""
    torch.set_num_threads(1)  # ranks share the host's cores; oversubscription only adds noise
    res: dict[str, Any] = {"rank": rank}
    try:
        state = init_distributed(
            "gloo", rank, job.world, job.init_method, tp_size=job.tp, pp_size=job.pp,
            timeout_s=job.init_timeout_s,
        )
        if job.late_peer_s:
            res["late"] = _late_peer(state, job.late_peer_s)
            return
        res["runs"] = [_run(job, state, overlap) for overlap in job.overlaps]
        if job.extras:
            res["ar_p50_us"] = _all_reduce_p50_us(state)
            res["stall"] = _stall(state, Path(job.out_dir) / "rank0-timed-out")
    except BaseException:
        res["error"] = traceback.format_exc()
    finally:
        torch.save(res, Path(job.out_dir) / f"rank{rank}.pt")
        destroy()
    if "error" in res:
        raise SystemExit(1)


def _run(job: Job, state: ParallelState, overlap: bool) -> dict[str, Any]:
    buf: list[tuple[Any, ...]] = []
    sm = ShardedModel.load(
        job.ckpt, state, overlap=overlap, probe_buf=buf, timeout_s=RANK_TIMEOUT_S
    )
    reqs = oracle.make_reqs(sm.full_cfg.vocab_size, 7, LENGTHS, CHUNKS, MAX_NEW)  # test_model_oracle's prompts
    got: list[bool] = []
    kvs: list[PagedKVCache] = []

    def make_kv(n: int) -> PagedKVCache:
        kvs.append(sm.make_kv_cache(n, BLOCK))
        return kvs[-1]

    def forward(fb: ForwardBatch, kv: PagedKVCache, step: int) -> torch.Tensor:
        logits = sm.step(fb, kv, step)
        got.append(logits is not None)
        if logits is None:
            logits = torch.empty(fb.num_sampled, sm.full_cfg.vocab_size)
        # The engine will broadcast sampled tokens; shipping the logits keeps the shared loop
        # (argmax on every rank) unchanged.
        if fb.num_sampled:
            dist.broadcast(logits, src=state.logits_rank)
        return logits

    steps = oracle.generate(forward, make_kv, reqs)
    comm = sm.tp.comm if sm.tp is not None else None
    return {
        "overlap": overlap,
        "steps": steps,
        "got_logits": got,
        "prompts": [r.prompt for r in reqs],
        "out": [r.out for r in reqs],
        "logits": [torch.stack(r.logits) for r in reqs],
        "probes": buf,
        "records": [] if comm is None else [
            (c.seq, c.step, c.numel, c.overlapped, c.issue_ns, c.end_ns, c.wait_ns)
            for c in comm.records
        ],
        "in_flight": [] if comm is None else comm.in_flight(),
        "sync_fallbacks": sm.tp.sync_fallbacks if sm.tp is not None else 0,
        "kv": (kvs[0].num_layers, kvs[0].num_kv_heads),
        "cfg": (sm.cfg.num_attention_heads, sm.cfg.num_key_value_heads, sm.cfg.intermediate_size),
        "part": (sm.model.part.first_layer, sm.model.part.num_layers, sm.model.part.embed,
                 sm.model.part.head),
    }


def _all_reduce_p50_us(state: ParallelState) -> float:
    """A decode-sized all-reduce ([16, 96] float32, 6 KiB), synchronous, 2 gloo ranks."""
    comm = AllReduce(state.tp_group, state.rank, timeout_s=RANK_TIMEOUT_S)
    x = torch.randn(16, 96)
    times = []
    for i in range(220):
        t0 = time.perf_counter_ns()
        comm(x)
        if i >= 20:  # warm-up
            times.append(time.perf_counter_ns() - t0)
    return sorted(times)[len(times) // 2] / 1e3


def _stall(state: ParallelState, timed_out: Path) -> dict[str, Any]:
    """Rank 1 joins all-reduce #0 late: rank 0's wait times out naming it, then completes.
    Rank 1 joins once rank 0's wait gave up (the file `timed_out`), not after a sleep a
    starved rank 0 could outlast."""
    comm = AllReduce(state.tp_group, state.rank, timeout_s=0.3)
    t = torch.full((4,), float(state.rank + 1))
    if state.rank == 1:
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while not timed_out.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    p = comm.issue(t)
    out: dict[str, Any] = {}
    if state.rank == 0:
        try:
            comm.wait(p)
        except WaitTimeout as e:
            out["msg"] = str(e)
            out["in_flight"] = comm.in_flight()
        timed_out.touch()
        comm.timeout_s = RANK_TIMEOUT_S  # the group is still usable: the late peer completes it
    comm.wait(p)
    out["sum"] = t.tolist()
    return out


def _late_peer(state: ParallelState, late_s: float) -> list[float]:
    """An all-reduce rank 1 joins `late_s` after rank 0, inside the wait's own timeout."""
    comm = AllReduce(state.tp_group, state.rank, timeout_s=RANK_TIMEOUT_S)
    if state.rank == 1:
        time.sleep(late_s)
    return comm(torch.full((2,), float(state.rank + 1))).tolist()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(job_kw: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    """Run ``world`` ranks; no child outlives this call, whatever happens."""
    # forked from the forkserver, which imports torch and this module once for every rank of
    # the session (a spawned rank imports them itself, ~3 s of CPU, most of its work here);
    # if a test of this worker started the server first, it preloaded torch for the device
    ctx = late_context(["torch", __name__])
    job = Job(out_dir=str(tmp_path), init_method=f"tcp://127.0.0.1:{_free_port()}", **job_kw)
    procs = [ctx.Process(target=_rank_main, args=(r, job), daemon=True) for r in range(job.world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOB_TIMEOUT_S
        live = list(procs)
        while live:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"ranks still running after {JOB_TIMEOUT_S:.0f} s")
            multiprocessing.connection.wait([p.sentinel for p in live], timeout=left)
            live = [p for p in live if p.exitcode is None]
            if any(p.exitcode for p in procs):
                break  # one rank failed: its peers would only wait out their timeouts
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not any(p.is_alive() for p in procs)
    assert not ctx.active_children()
    results, failures = [], []
    for r, p in enumerate(procs):
        f = tmp_path / f"rank{r}.pt"
        res = torch.load(f, weights_only=False) if f.is_file() else {"error": "(no result)"}
        if "error" in res or p.exitcode != 0:
            failures.append(f"rank {r} exit code {p.exitcode}: {res.get('error', '')}")
        results.append(res)
    if failures:
        pytest.fail("\n".join(failures))
    return results


def check_all_reduce_probes(results: list[dict[str, Any]], run: int) -> None:
    """Every rank recorded one all_reduce probe row per collective, numbered 0, 1, 2, ... and
    the ranks of one TP group issued the same collectives in the same order."""
    for res in results:
        rr = res["runs"][run]
        recs = rr["records"]
        assert recs, f"rank {res['rank']}: no all-reduce records"
        assert [c[0] for c in recs] == list(range(len(recs)))  # seq increasing, no gaps
        assert all(c[5] >= c[4] and c[6] >= 0 for c in recs)  # completed and waited
        assert not rr["in_flight"]
        rows = [r for r in rr["probes"] if r[2] == ALL_REDUCE]
        assert len(rows) == len(recs)
        assert all(r[3] == "comm" and r[4] == res["rank"] and r[1] >= 0 for r in rows)
        assert [r[5] for r in rows] == sorted(r[5] for r in rows) and rows[0][5] >= 1  # steps


def check_oracle(ckpt: Path, res: dict[str, Any], run: int) -> None:
    rr = res["runs"][run]
    assert all(rr["got_logits"])
    oracle_check(ckpt, rr["prompts"], rr["out"], rr["logits"])


# ----------------------------------------------------------------------------- slow tests


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("par_ckpts")
    c = _builders()
    return {
        "llama": c.build_llama(root / "llama"),  # GQA 6 / 2, tied embeddings, 3 layers
        "mistral": c.build_mistral(root / "mistral"),  # MQA 4 / 1, sliding window, untied
        "qwen2": c.build_qwen2(root / "qwen2"),  # q/k/v bias, 2 layers
    }


@pytest.mark.slow
def test_tp2_gqa_splits_kv_heads(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """TP2 over GQA 6/2 (one KV head per rank), overlap off then on, against transformers."""
    t0 = time.monotonic()
    results = launch(
        dict(ckpt=str(ckpts["llama"]), world=2, tp=2, pp=1, overlaps=(False, True), extras=True),
        tmp_path,
    )
    r0, r1 = results
    for run in (0, 1):
        check_oracle(ckpts["llama"], r0, run)
        assert not any(r1["runs"][run]["got_logits"])  # logits only on the logits rank
        check_all_reduce_probes(results, run)
        for res in results:
            assert res["runs"][run]["cfg"] == (3, 1, 100)
            assert res["runs"][run]["kv"] == (3, 1)
        # same collectives, same order, same sizes on both ranks
        assert [c[:4] for c in r0["runs"][run]["records"]] == [
            c[:4] for c in r1["runs"][run]["records"]
        ]
    off, on = r0["runs"]
    assert not any(c[3] for c in off["records"]) and off["sync_fallbacks"] == 0
    assert any(c[3] for c in on["records"])  # overlapped collectives happened
    # the first steps hold one sequence: nothing independent, synchronous fallback
    assert on["sync_fallbacks"] > 0 and any(not c[3] for c in on["records"])
    # a decode step of both splits issues 2 micro-batches x 2 all-reduces x 3 layers
    assert len(on["records"]) > len(off["records"])
    stall = r0["stall"]
    assert stall["msg"] == "rank0 waited 0.3 s for all_reduce #0 (to be signalled by tp group)"
    assert stall["in_flight"] == [0] and stall["sum"] == [3.0] * 4
    print(f"\n2-rank gloo all-reduce [16, 96] fp32 p50: rank0 {r0['ar_p50_us']:.0f} us, "
          f"rank1 {r1['ar_p50_us']:.0f} us; test {time.monotonic() - t0:.1f} s")


@pytest.mark.slow
def test_tp2_mqa_replicates_kv_head(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """MQA (1 KV head < tp 2): both ranks keep KV head 0; sliding window, overlap on."""
    results = launch(
        dict(ckpt=str(ckpts["mistral"]), world=2, tp=2, pp=1, overlaps=(True,)), tmp_path
    )
    check_oracle(ckpts["mistral"], results[0], 0)
    check_all_reduce_probes(results, 0)
    for res in results:
        assert res["runs"][0]["cfg"] == (2, 1, 72) and res["runs"][0]["kv"] == (2, 1)


@pytest.mark.slow
def test_pp2_stages(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """PP2 over 3 layers (2 + 1); tied embeddings, so the last stage loads its own LM head."""
    results = launch(
        dict(ckpt=str(ckpts["llama"]), world=2, tp=1, pp=2, overlaps=(False,)), tmp_path
    )
    s0, s1 = (res["runs"][0] for res in results)
    check_oracle(ckpts["llama"], results[1], 0)
    assert not any(s0["got_logits"])
    assert s0["part"] == (0, 2, True, False) and s1["part"] == (2, 1, False, True)
    assert s0["kv"] == (2, 2) and s1["kv"] == (1, 2)  # per-stage KV, all 2 KV heads
    assert not s0["records"] and not s1["records"]  # no TP, no all-reduce
    bubbles = [r for r in s1["probes"] if r[2] == PP_BUBBLE]
    # one input wait per micro-batch: two in a round of two or more sequences (pipelined halves)
    steps = len(s1["got_logits"])
    assert steps < len(bubbles) <= 2 * steps
    assert all(r[3] == "comm" and r[4] == 1 for r in bubbles)
    assert not [r for r in s0["probes"] if r[2] == PP_BUBBLE]  # stage 0 waits for no input


@pytest.mark.slow
def test_tp2_pp2(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """4 ranks: rank = pp_rank * 2 + tp_rank; logits on rank 2; q/k/v biases sharded."""
    results = launch(
        dict(ckpt=str(ckpts["qwen2"]), world=4, tp=2, pp=2, overlaps=(True,)), tmp_path
    )
    runs = [res["runs"][0] for res in results]
    check_oracle(ckpts["qwen2"], results[2], 0)
    assert [any(r["got_logits"]) for r in runs] == [False, False, True, False]
    assert [r["part"] for r in runs] == [
        (0, 1, True, False), (0, 1, True, False), (1, 1, False, True), (1, 1, False, False)
    ]
    check_all_reduce_probes(results, 0)
    assert all(any(p[2] == PP_BUBBLE for p in r["probes"]) == (i >= 2) for i, r in enumerate(runs))


# ----------------------------------------------------------------------------- fast tests


def _cfg(heads: int, kv: int, inter: int = 96) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8 * heads,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv,
    })


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "expected"),
    [
        (6, 2, 2, [[0], [1]]),  # partitioned
        (8, 4, 2, [[0, 1], [2, 3]]),
        (4, 1, 2, [[0], [0]]),  # MQA: replicated
        (8, 2, 4, [[0], [0], [1], [1]]),  # kv < tp: each head on tp / kv ranks
        (6, 3, 2, [[0, 0, 1], [1, 2, 2]]),  # neither divides: expanded per query head
        (6, 2, 3, [[0, 0], [0, 1], [1, 1]]),
        (4, 4, 1, [[0, 1, 2, 3]]),
    ],
)
def test_kv_head_rule(heads: int, kv: int, tp: int, expected: list[list[int]]) -> None:
    cfg = _cfg(heads, kv)
    assert [kv_heads_for_rank(cfg, r, tp) for r in range(tp)] == expected
    local = tp_config(cfg, tp)
    assert local.num_attention_heads == heads // tp
    assert local.num_key_value_heads == len(expected[0])
    assert local.num_attention_heads % local.num_key_value_heads == 0  # grouped attention works


def test_tp_config_rejects_indivisible() -> None:
    with pytest.raises(ModelLoadError, match="6 attention heads not divisible by tp_size 4"):
        tp_config(_cfg(6, 2), 4)
    with pytest.raises(ModelLoadError, match="intermediate_size 64 not divisible by tp_size 3"):
        tp_config(_cfg(6, 2, inter=64), 3)


def test_stage_layers_balanced() -> None:
    assert [list(stage_layers(3, 2, p)) for p in range(2)] == [[0, 1], [2]]
    assert [len(stage_layers(10, 4, p)) for p in range(4)] == [3, 3, 2, 2]
    with pytest.raises(ModelLoadError):
        stage_layers(2, 3, 0)


class _ThreadSum:
    """TP ranks as threads: a blocking sum over per-rank tensors (identical order everywhere)."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * n

    def hook(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = sum(p for p in self.parts if p is not None)
            self.barrier.wait()  # nobody overwrites parts before everyone summed
            assert isinstance(total, torch.Tensor)
            return total

        return all_reduce


def _mixed_steps(vocab: int) -> Iterator[list[SeqChunk]]:
    """Steps ending in a mixed batch: decodes, a continued prefill chunk and a fresh prompt."""
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 20, 12))
    yield [SeqChunk(a[:36], 0, [0, 1, 2], True), SeqChunk(b[:10], 0, [3, 4], True)]
    yield [
        SeqChunk(a[36:], 36, [0, 1, 2], True),  # decode-shaped
        SeqChunk(b[10:], 10, [3, 4], True),  # prefill continuing from the cache
        SeqChunk(c, 0, [5], True),  # fresh prefill
        SeqChunk([c[0]], 0, [6], True),  # 1-token prompt
    ]


@pytest.mark.parametrize(
    ("name", "overrides", "tp"),
    [
        ("llama", {}, 2),  # GQA partitioned
        ("llama", {"num_key_value_heads": 3, "attention_bias": True, "mlp_bias": True}, 2),
        ("llama", {}, 3),  # expanded KV heads, 3 ranks
        ("mistral", None, 2),  # MQA replicated, sliding window
        ("qwen2", None, 2),  # q/k/v bias
    ],
)
def test_tp_shards_sum_to_single_process(
    name: str, overrides: dict[str, Any] | None, tp: int, tmp_path: Path
) -> None:
    """Load every TP rank's shard and run the ranks as threads: logits == one process's."""
    c = _builders()
    if name == "llama":
        ckpt = c.build_llama(tmp_path / name, intermediate_size=192, **(overrides or {}))
    else:
        ckpt = c.BUILDERS[name](tmp_path / name)
    whole, full = load_model(ckpt)
    ranks = []
    summer = _ThreadSum(tp)
    for r in range(tp):
        m, _ = load_model(
            ckpt, shard_fn=tp_shard_fn(full, r, tp), cfg=tp_config(full, tp),
            all_reduce=summer.hook(r),
        )
        ranks.append(m)
    kvs = [m.make_kv_cache(8, BLOCK) for m in ranks]
    ref_kv = whole.make_kv_cache(8, BLOCK)
    for chunks in _mixed_steps(full.vocab_size):
        fb = build_forward_batch(chunks, BLOCK, "cpu")
        ref = whole(fb, ref_kv)
        for got in _run_rank_threads(ranks, kvs, fb, summer):
            torch.testing.assert_close(got, ref, atol=1e-4 * max(ref.abs().max().item(), 1), rtol=0)


def _run_rank_threads(
    ranks: list[Any], kvs: list[PagedKVCache], fb: ForwardBatch, summer: _ThreadSum
) -> list[torch.Tensor]:
    got: list[torch.Tensor | None] = [None] * len(ranks)
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            got[r] = ranks[r](fb, kvs[r])
        except BaseException as e:  # surfaced below; a dead thread would hang the barrier
            errors.append(e)
            summer.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    return [g for g in got if g is not None]


class _LocalComm:
    """A one-rank stand-in for AllReduce (the sum over one rank is the tensor itself)."""

    step = -1

    def issue(self, t: torch.Tensor, *, overlapped: bool = True) -> torch.Tensor:
        return t

    def wait(self, p: torch.Tensor) -> torch.Tensor:
        return p

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_overlap_split_matches_whole_batch(name: str, tmp_path: Path) -> None:
    """The overlap schedule (two micro-batches, interleaved per layer) on one rank gives the
    same logits as the plain forward, on mixed decode/prefill batches."""
    ckpt = _builders().BUILDERS[name](tmp_path / name)
    model, cfg = load_model(ckpt)
    runner = TPRunner(model, _LocalComm(), overlap=True)  # type: ignore[arg-type]
    kv_a, kv_b = model.make_kv_cache(8, BLOCK), model.make_kv_cache(8, BLOCK)
    for chunks in _mixed_steps(cfg.vocab_size):
        fb = build_forward_batch(chunks, BLOCK, "cpu")
        ref = model(fb, kv_a)
        with torch.inference_mode():
            got = model.compute_logits(runner.run_layers(model.embed(fb), fb, kv_b), fb)
        torch.testing.assert_close(got, ref, atol=1e-4 * max(ref.abs().max().item(), 1), rtol=0)
    assert runner.sync_fallbacks == 0
    torch.testing.assert_close(kv_a.k[0], kv_b.k[0], atol=1e-5, rtol=0)


def test_split_row_and_slice() -> None:
    chunks = [
        SeqChunk([10, 11, 12], 0, [4], False),
        SeqChunk([20], 17, [1, 0], True),
        SeqChunk([30, 31], 5, [2], True),
        SeqChunk([40], 0, [3], True),
    ]
    b = build_forward_batch(chunks, BLOCK, "cpu")  # rows: 2 decodes, then 3 + 2 prefill rows
    assert split_row(b) == 2  # the decode/prefill boundary halves 7 rows best
    head, tail = slice_batch(b, 0, 2), slice_batch(b, 2, 7)
    assert (head.num_decode, len(head.prefills), head.num_seqs) == (2, 0, 2)
    assert (tail.num_decode, tail.decode_blocks, len(tail.prefills)) == (0, None, 2)
    assert [(p.row_start, p.row_end) for p in tail.prefills] == [(0, 3), (3, 5)]
    assert tail.input_ids.tolist() == [10, 11, 12, 30, 31]
    one = build_forward_batch([SeqChunk([1, 2, 3], 0, [0], True)], BLOCK, "cpu")
    assert split_row(one) is None  # nothing independent: synchronous fallback


def test_sharded_model_single_rank(tmp_path: Path) -> None:
    """tp = pp = 1 without torch.distributed: ShardedModel is the plain model."""
    ckpt = _builders().build_llama(tmp_path / "llama")
    sm = ShardedModel.load(ckpt, ParallelState.single())
    model, cfg = load_model(ckpt)
    assert sm.tp is None and not sm.overlap and sm.cfg == cfg
    kv_a, kv_b = sm.make_kv_cache(8, BLOCK), model.make_kv_cache(8, BLOCK)
    assert kv_a.nbytes == 8 * sm.kv_bytes_per_block(BLOCK)
    for chunks in _mixed_steps(cfg.vocab_size):
        fb = build_forward_batch(chunks, BLOCK, "cpu")
        got = sm.step(fb, kv_a)
        assert got is not None
        torch.testing.assert_close(got, model(fb, kv_b), atol=0, rtol=0)


def test_a_tp_collective_waits_as_long_as_its_waiter_allows_not_the_groups_setup_timeout(tmp_path: Path) -> None:
    """gloo applies a group's timeout to each collective: the TP group took the setup's (60 s
    in a run), which cut an all-reduce whose waiter allows longer (--on-stall continue, a long
    --wait-timeout) with a raw gloo error. Here setup's is 5 s (room for two forked ranks to meet
    on a loaded host) and the peer is 7 s late."""
    results = launch({"ckpt": "", "world": 2, "tp": 2, "pp": 1, "overlaps": (), "init_timeout_s": 5.0,
                      "late_peer_s": 7.0}, tmp_path)
    assert [r["late"] for r in results] == [[3.0, 3.0], [3.0, 3.0]]
