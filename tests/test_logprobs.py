"""Logprobs and prompt logprobs (echo): the engine's, against transformers' log_softmax of
the same sequence, through every backend and scheduling mode, with the prompt cut into chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler.config import EngineConfig
from scheduler.core.request import SamplingParams, TokenLogprob
from scheduler.engine import Engine
from scheduler.parallel.coordinator import Coordinator
from tests.support.engines import drive

TOL = 1e-4
K = 5


class Capture:
    """A sender sink that keeps what it is given, as the HTTP front end's does."""

    def __init__(self) -> None:
        self.prompt: dict[str, list[TokenLogprob | None]] = {}
        self.tokens: dict[str, list[tuple[int, TokenLogprob]]] = {}
        self.texts: dict[str, int] = {}

    def on_logprobs(self, rid: str, prompt: tuple[list[int], list[TokenLogprob | None]] | None,
                    token: tuple[int, TokenLogprob] | None) -> None:
        if prompt is not None:
            assert rid not in self.prompt, "prompt logprobs come once, with the first token"
            self.prompt[rid] = prompt[1]
        if token is not None:
            self.tokens.setdefault(rid, []).append(token)

    def on_text(self, rid: str, text: str) -> None:
        self.texts[rid] = self.texts.get(rid, 0) + 1

    def on_finish(self, record: object, text: str) -> None:
        pass


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()


def run(ckpt: Path, reqs: dict[str, tuple[list[int], SamplingParams]], trace_dir: Path,
        **kw: object) -> tuple[Engine, Capture]:
    sink = Capture()
    cfg = EngineConfig(model=str(ckpt), block_size=4, kv_blocks=256, dtype="float32", **kw)  # type: ignore[arg-type]
    # TP: rank 0 samples from the logits it gathers, the other ranks are spawned as `run` spawns them
    coord = Coordinator.start(cfg, trace_dir) if cfg.world_size > 1 else None
    eng = Engine(cfg, sinks=[sink], parallel=coord)
    try:
        for rid, (prompt, sp) in reqs.items():
            eng.submit(prompt, sp, rid)
        drive(eng)
    finally:
        eng.close()
        if coord is not None:
            coord.close(True)
    return eng, sink


def reference(hf: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row p predicts the token at p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)


def check_entry(e: TokenLogprob, ref_row: torch.Tensor, token: int, k: int) -> None:
    assert abs(e.logprob - float(ref_row[token])) < TOL
    assert len(e.top_ids) == len(e.top_logprobs) == k
    top = ref_row.topk(k)
    assert max(abs(a - b) for a, b in zip(e.top_logprobs, top.values.tolist(), strict=True)) < TOL if k else True
    assert e.top_ids == top.indices.tolist()


CASES = [
    pytest.param(dict(cpu_device="thread", mode="serial"), id="thread-serial"),
    pytest.param(dict(cpu_device="thread", mode="overlap"), id="thread-overlap"),
    pytest.param(dict(cpu_device="process", mode="overlap"), id="process-overlap"),
    pytest.param(dict(cpu_device="thread", mode="serial", tp=2), id="tp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("cfg", CASES)
def test_logprobs_match_transformers(ckpt: Path, hf: torch.nn.Module, cfg: dict[str, object],
                                    tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (23, 9, 40)]
    reqs = {
        "echo": (prompts[0], SamplingParams(6, ignore_eos=True, logprobs=K, prompt_logprobs=K)),
        "plain": (prompts[1], SamplingParams(6, ignore_eos=True)),  # asks for none, batched with the others
        "top0": (prompts[2], SamplingParams(5, temperature=0.8, seed=3, ignore_eos=True, logprobs=0,
                                            prompt_logprobs=2)),
    }
    # prefill_chunk 7: every prompt is scored across chunks, a chunk's last row against the next's first token
    eng, sink = run(ckpt, reqs, tmp_path, prefill_chunk=7, **cfg)
    out = {r.request_id: r.output_ids for r in eng.rm.finished}
    assert "plain" not in sink.tokens and "plain" not in sink.prompt
    for rid, k_out, k_prompt in (("echo", K, K), ("top0", 0, 2)):
        prompt = reqs[rid][0]
        ref = reference(hf, prompt + out[rid])
        toks = sink.tokens[rid]
        assert [t for t, _ in toks] == out[rid]
        for j, (tok, e) in enumerate(toks):
            check_entry(e, ref[len(prompt) - 1 + j], tok, k_out)
        scored = sink.prompt[rid]
        assert len(scored) == len(prompt) and scored[0] is None
        for p in range(1, len(prompt)):
            e = scored[p]
            assert e is not None, f"{rid}: prompt position {p} not scored"
            check_entry(e, ref[p - 1], prompt[p], k_prompt)


def test_prompt_logprobs_skip_the_prefix_cache(ckpt: Path, hf: torch.nn.Module) -> None:
    """A prompt that is cached in full is still scored in full: a cached position has no logits."""
    prompt = list(range(10, 50))
    first = {"warm": (prompt, SamplingParams(2, ignore_eos=True))}
    sink = Capture()
    eng = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_blocks=256, cpu_device="thread", dtype="float32"),
                 sinks=[sink])
    try:
        for reqs in (first, {"scored": (prompt, SamplingParams(2, ignore_eos=True, prompt_logprobs=1)),
                             "cached": (prompt, SamplingParams(2, ignore_eos=True))}):
            for rid, (p, sp) in reqs.items():
                eng.submit(p, sp, rid)
            drive(eng)
        got = {r.request_id: r for r in eng.rm.finished}
    finally:
        eng.close()
    assert got["cached"].num_cached_prefix > 0 and got["scored"].num_cached_prefix == 0
    ref = reference(hf, prompt)
    scored = sink.prompt["scored"]
    assert all(abs(scored[p].logprob - float(ref[p - 1, prompt[p]])) < TOL for p in range(1, len(prompt)))  # type: ignore[union-attr]


def test_logprobs_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="logprobs must be between 0 and 20"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.slow
def test_pipeline_parallel_refuses_logprobs_and_serves_the_rest(ckpt: Path, tmp_path: Path) -> None:
    """Under --pp > 1 the logits live on another rank: a request asking for logprobs is
    rejected with the reason, and its neighbours run as usual."""
    reqs = {"lp": ([5, 6, 7, 8], SamplingParams(3, ignore_eos=True, logprobs=1)),
            "ok": ([5, 6, 7, 9], SamplingParams(3, ignore_eos=True))}
    eng, sink = run(ckpt, reqs, tmp_path, cpu_device="thread", mode="serial", pp=2)
    got = {r.request_id: r for r in eng.rm.finished}
    assert got["lp"].finish_reason == "rejected" and "--pp > 1" in got["lp"].finish_detail
    assert got["ok"].finish_reason == "length" and len(got["ok"].output_ids) == 3
    assert not sink.tokens
