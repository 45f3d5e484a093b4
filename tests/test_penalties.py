"""Penalties, logit_bias, min_tokens and stop_token_ids: the device's pass against a plain
reference of vLLM's semantics, and the engine's greedy tokens against transformers' logits
processed by that reference, in serial and overlap mode (whose histories end in tokens still
on the device)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from scheduler.config import EngineConfig
from scheduler.core.request import FinishReason, SamplingParams
from scheduler.engine import Engine
from scheduler.model.penalties import apply
from tests.support.checkpoints import set_eos
from tests.support.engines import drive

V = 300


def reference(logits: list[float], prompt: list[int], outs: list[int], sp: SamplingParams,
              eos: set[int]) -> list[float]:
    """vLLM's order, one row, plain Python: min_tokens and logit_bias, then repetition, then
    frequency and presence penalties."""
    x = list(logits)
    for t, b in sp.logit_bias:
        x[t] += b
    if len(outs) < sp.min_tokens:
        for t in (*eos, *sp.stop_token_ids):
            x[t] = float("-inf")
    seen = set(prompt) | set(outs)
    for t in range(len(x)):
        if t in seen and sp.repetition_penalty != 1.0:
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
        c = outs.count(t)
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty * (c > 0)
    return x


tokens = st.lists(st.integers(0, 19), max_size=12)


@settings(max_examples=200, deadline=None)
@given(logits=st.lists(st.floats(-5, 5), min_size=20, max_size=20), prompt=tokens, outs=tokens,
       rep=st.sampled_from([1.0, 0.5, 1.3]), freq=st.sampled_from([0.0, 0.7, -0.4]),
       pres=st.sampled_from([0.0, 1.5, -1.0]), min_tokens=st.integers(0, 4),
       bias=st.lists(st.tuples(st.integers(0, 19), st.floats(-100, 100)), max_size=3))
def test_device_pass_equals_the_reference(logits, prompt, outs, rep, freq, pres, min_tokens, bias) -> None:
    sp = SamplingParams(16, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                        min_tokens=min_tokens, logit_bias=tuple(bias), stop_token_ids=(3,))
    from scheduler.core.batch import ScheduledChunk
    from scheduler.core.request import ReqSample, Request
    from scheduler.device.executor import logits_adjust

    req = Request(ReqSample("r", prompt or [0], len(prompt or [0]), sp, 0))
    req.output_ids = list(outs)
    # a row that asks nothing sits before it: rows are indexed, not assumed to be all of the batch
    plain = Request(ReqSample("p", [1], 1, SamplingParams(16), 0))
    adj = logits_adjust([ScheduledChunk(plain, 0, 1, True), ScheduledChunk(req, 0, 1, True)], frozenset({7}))
    want = reference(logits, prompt or [0], outs, sp, {7})
    if adj is None:  # nothing asked: nothing to do, and nothing done
        assert not sp.adjusts_logits and want == logits
        return
    x = torch.tensor([[0.0] * 20, logits], dtype=torch.float32)
    got = apply(x, adj, None)
    assert got[0].tolist() == [0.0] * 20
    assert torch.allclose(got[1], torch.tensor(want, dtype=torch.float32), atol=1e-4, equal_nan=False)
    assert x[1].tolist() == pytest.approx(logits)  # the raw logits stay for logprobs


def finished(ckpt: Path, reqs: dict[str, tuple[list[int], SamplingParams]], **kw: object) -> dict:
    """The requests run to the end on a new engine: each finished one, by id."""
    kw.setdefault("cpu_device", "thread")
    eng = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_blocks=256, dtype="float32", **kw))  # type: ignore[arg-type]
    try:
        for rid, (p, sp) in reqs.items():
            eng.submit(p, sp, rid)
        drive(eng)
        return {r.request_id: r for r in eng.rm.finished}
    finally:
        eng.close()


@pytest.mark.parametrize("mode,device", [("serial", "thread"), ("overlap", "thread"), ("overlap", "process")])
def test_greedy_tokens_follow_transformers_logits_through_the_reference(ckpt: Path, mode: str, device: str) -> None:
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 14, 6)]
    free = finished(ckpt, {f"r{i}": (p, SamplingParams(10, ignore_eos=True)) for i, p in enumerate(prompts)}, mode=mode,
                 cpu_device=device)
    params = [SamplingParams(10, ignore_eos=True, repetition_penalty=0.2, frequency_penalty=2.0),  # <1: seen tokens boosted
              # the unpenalised run's third token is pushed out; another one pulled a little
              SamplingParams(10, ignore_eos=True, presence_penalty=1.5,
                             logit_bias=((free["r1"].output_ids[2], -100.0), (17, 2.0))),
              SamplingParams(10, ignore_eos=True)]
    got = finished(ckpt, {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))},
                mode=mode, cpu_device=device)
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        outs: list[int] = []
        for _ in range(sp.max_new_tokens):
            with torch.no_grad():
                row = hf(torch.tensor([prompt + outs])).logits[0, -1].float().tolist()
            x = reference(row, prompt, outs, sp, set())
            outs.append(max(range(V), key=x.__getitem__))
        assert got[f"r{i}"].output_ids == outs, f"r{i} in {mode}"
    assert got["r0"].output_ids != free["r0"].output_ids and got["r1"].output_ids != free["r1"].output_ids
    assert got["r2"].output_ids == free["r2"].output_ids  # batched with them, asking nothing


def test_stop_token_ids_and_min_tokens(ckpt: Path, tmp_path: Path) -> None:
    prompt = [11, 42, 7, 99, 5]
    ref = finished(ckpt, {"a": (prompt, SamplingParams(12, ignore_eos=True))})["a"].output_ids
    stop = ref[4]
    first = ref.index(stop)
    got = finished(ckpt, {"a": (prompt, SamplingParams(12, ignore_eos=True, stop_token_ids=(stop,)))})["a"]
    assert got.finish_reason is FinishReason.STOP_TOKEN and got.output_ids == ref[: first + 1]
    # min_tokens bans EOS (and the stop tokens) until that many are out
    eos_dir = tmp_path / "eos"
    shutil.copytree(ckpt, eos_dir)
    set_eos(eos_dir, [ref[0]])
    early = finished(eos_dir, {"a": (prompt, SamplingParams(12))})["a"]
    assert early.finish_reason is FinishReason.EOS and early.output_ids == ref[:1]
    late = finished(eos_dir, {"a": (prompt, SamplingParams(12, min_tokens=4))})["a"]
    assert len(late.output_ids) >= 4 and ref[0] not in late.output_ids[:4]
