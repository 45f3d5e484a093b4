"""Roofline of the engine's forward: how far each part is from its own limit on this machine.

Input: the forward batches of a real engine run (bench_engine_vs_hf.py's workload by
default: the default preset, 128 requests, prompts 16-512, outputs 16-256, everything
arriving at once), captured as the engine hands them to the model. Every captured batch
is then run again through a mirror of `CausalLM.forward` that times each part, and the
mirror's logits are checked bit-equal to the model's own on every batch, so the parts are
the forward's and nothing else.

Parts: embed, plan (RoPE lookup and attention masks, once a batch), norm (each layer's
input norm), qkv, rope_kv (RoPE and the KV write, one call), attn_decode and attn_prefill
(`layers.paged_attention`'s two halves: the decode rows, each reading its context from the
paged cache, then the prefill chunks and the join of the two), o_proj, add_norm
(the residual add after attention and the norm before the MLP, one call), gate_up, act
(SiLU and gating: one C pass where torch runs its AVX-512 kernels or, in float32, its AVX2
ones; torch's two ops elsewhere or with `--torch-gating`; inside gate_up where the AMX kernel
does it in the GEMM's pass), down,
residual (the MLP's add), logits (the final norm and the LM head over the sampled rows),
sample (the greedy pick: one C pass on the CPU, torch's argmax with `--torch-argmax`). What
the parts' timers do not cover of the whole forward's own time (the loop, attribute
look-ups) is shown as `unattributed`.

Limits, measured here at the same thread count (the GEMM peak and the copy bandwidth before and after the replay,
the higher of each kept). Each part's limit is
a roofline: the larger of its FLOPs at the peak GEMM rate (the best of square GEMMs of
512-2048 in the run's dtype, with torch.mm and with the engine's GEMM on a reordered weight,
`peak_gflops`) and the bytes it must read and write at the
memory bandwidth (the best of large copies, `bandwidth_gbs`), counted at the least: no
padding, attention over its causal keys only, each tensor once. A decode round's GEMMs
are bound by reading their weights, a prefill round's by their FLOPs. The limit is taken
batch by batch and summed, so a batch bound by its bytes does not hide behind another's FLOPs
(nor a batch's decode rows' bytes behind its prefill chunks' FLOPs: the two halves of the
attention are parts of their own). Beside the GEMM
parts and the SiLU-gating, the same-shape op alone (`shape ms`: the part with no neighbours,
at its own shapes, random inputs, best of `--reps`). The gating's limit counts its bytes only,
but its exp bounds it too: `shape ms` says what it costs where its input is in cache.

Output: a table of the parts sorted by the time they lose against their limit, for the
whole run and for its prefill-heavy and decode-heavy rounds, each headed by the forward's
share of the GEMM peak and the share a forward with every part exactly at its limit would
reach (the bound the machine and the model set); JSON to bench/out/. The peak is measured
before and after the replay and the higher kept: a shared machine's speed moves within
minutes. The forward in the tables runs its layers in Python, as the mirror does; where the
engine runs a decode round's layers in one C call (scheduler/model/native_layers.py), a line
under each table gives that forward's time too (the same logits, checked).

    .venv/bin/python bench/bench_forward.py                 # the default workload, 1 thread
    .venv/bin/python bench/bench_forward.py --requests 16   # smoke
    .venv/bin/python bench/bench_forward.py --torch-gating  # the gating by torch's ops (an A/B)
    # bench_serve_peer's load: 64 prompts of 128, 64 tokens each, 16 at a time, in bfloat16
    .venv/bin/python bench/bench_forward.py --dtype bfloat16 --requests 64 --prompt-len 128-128 \
        --output-len 64-64 --max-running 16
    # what the weights' and the KV pool's 2 MB pages are worth: the batches three ways in turn
    .venv/bin/python bench/bench_forward.py --pages-ab [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
from bench_engine_vs_hf import make_workload, parse_range  # noqa: E402
from common import OUT, load, python_layers  # noqa: E402

from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.harness.runner import run_workload  # noqa: E402
from scheduler.harness.workload import SyntheticSpec  # noqa: E402
from scheduler.model import huge_pages, native_elementwise, packed_gemm  # noqa: E402
from scheduler.model.forward_batch import ForwardBatch  # noqa: E402
from scheduler.model.kv_cache import PagedKVCache  # noqa: E402
from scheduler.model.layers import (  # noqa: E402
    add_norm,
    decode_attention,
    join_rows,
    prefill_attention,
    rms_norm,
    rope_store,
    silu_gate,
)
from scheduler.model.loader import load_model  # noqa: E402
from scheduler.model.presets import resolve_model  # noqa: E402
from scheduler.model.sampling import greedy_pick  # noqa: E402
from scheduler.model.transformer import CausalLM  # noqa: E402

ALONE = ("qkv", "o_proj", "gate_up", "down", "logits", "act")  # the parts timed alone at their shapes (shape_alone_s)
BYTES_PARTS = ("embed", "norm", "rope_kv", "attn_decode", "add_norm", "act", "residual", "sample")
PARTS = ("embed", "plan", "norm", "qkv", "rope_kv", "attn_decode", "attn_prefill", "o_proj", "add_norm", "gate_up",
         "act", "down", "residual", "logits", "sample")
F32 = 4


# --------------------------------------------------------------------------- machine limits
def _best_s(fn: Any, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def peak_gflops(dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """GEMM rates in `dtype` over squares of 512-2048, each with torch.mm and with the GEMM the
    engine runs on a reordered weight (`packed_gemm`: oneDNN's, or the AMX kernel), where this
    build has it; the best of them is what "GEMM peak" means here. Both, since neither is the
    machine's best everywhere: on a 2-vCPU AMD EPYC (Zen 5) torch.mm (MKL) ran float32 at
    about 100 GFLOP/s and oneDNN's reordered GEMM at 230-240 (BENCHMARKS.md), so a peak of
    torch.mm's alone put the forward above 100% of it."""
    packs = packed_gemm.unpackable(dtype) is None
    out = {}
    for n in (512, 1024, 1536, 2048):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        out[f"mm {n}"] = 2 * n ** 3 / _best_s(lambda a=a, b=b: torch.mm(a, b), 5) / 1e9
        if packs:
            w = packed_gemm.pack(b.t().contiguous())  # (as the engine packs: its default rows hint)
            out[f"packed {n}"] = 2 * n ** 3 / _best_s(lambda a=a, w=w: packed_gemm.linear(a, w, None), 5) / 1e9
    return out


def bandwidth_gbs() -> float:
    """The best of large copies (read + write), GB/s: the elementwise parts' limit."""
    src = torch.randn(32 * 1024 * 1024)  # 128 MB: out of every cache
    dst = torch.empty_like(src)
    return 2 * src.numel() * F32 / _best_s(lambda: dst.copy_(src), 7) / 1e9


# --------------------------------------------------------------------------- capture
def block_runs(fbs: list[ForwardBatch]) -> str:
    """How the decode rows' KV blocks lie in the cache: the share that follow their row's previous
    block, and the mean run of such blocks. A scattered block is read at the rate of a shuffled
    16 KB read (bench/block_reads.c), a run at nearly a stream's."""
    follow = pairs = runs = 0
    for fb in fbs:
        if fb.decode_blocks is None:
            continue
        for row, n in zip(fb.decode_blocks.tolist(), (fb.positions[: fb.num_decode] + 1).tolist(), strict=True):
            blocks = row[: (n + fb.block_size - 1) // fb.block_size]
            steps = [b == a + 1 for a, b in zip(blocks, blocks[1:], strict=False)]
            follow, pairs, runs = follow + sum(steps), pairs + len(steps), runs + 1 + len(steps) - sum(steps)
    if not pairs:
        return "the decode rows' blocks: none past a row's first"
    # each block either starts a run or follows its row's previous block
    return (f"the decode rows' blocks: {follow / pairs:.1%} follow their row's previous block; "
            f"runs of {(runs + follow) / runs:.1f} blocks on average")


def capture(model_name: str, requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
            seed: int, weight_pack: str = "auto", dtype: str = "float32",
            max_running: int | None = None) -> tuple[list[ForwardBatch], CausalLM, PagedKVCache, float]:
    """Run the engine on the workload and keep every batch its model is given (the thread
    backend: the model runs in this process). Returns the batches, the model, its KV pool
    and the run's forward time as the engine saw it."""
    batches: list[ForwardBatch] = []
    seen: dict[str, Any] = {}
    fwd_ns = [0]
    inner = CausalLM.forward

    def recording(self: CausalLM, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        t = time.perf_counter_ns()
        out = inner(self, batch, kv)
        fwd_ns[0] += time.perf_counter_ns() - t
        if seen.get("on"):
            batches.append(batch)
            seen["model"], seen["kv"] = self, kv
        return out

    model_dir = resolve_model(model_name)
    spec = SyntheticSpec(requests=requests, prompt_len=prompt_len, output_len=output_len, shared_prefix_frac=0.0,
                         rate=0.0, ignore_eos=True, seed=seed)
    items, _ = make_workload(model_dir, spec)
    warm, _ = make_workload(model_dir, SyntheticSpec(requests=4, prompt_len=(16, 128), output_len=(4, 8),
                                                     shared_prefix_frac=0.0, rate=0.0, seed=seed + 1000))
    warm = [type(w)(f"warm-{i}", w.prompt, w.input_ids, w.params, w.arrival_s) for i, w in enumerate(warm)]
    CausalLM.forward = recording  # type: ignore[method-assign]
    # the dtype asked (float32 by default, whatever `--dtype auto` would pick here): the limits
    # and byte counts are that dtype's
    cfg = EngineConfig(cpu_device="thread", device="cpu", dtype=dtype, model=model_name,
                       device_threads=torch.get_num_threads(), weight_pack=weight_pack,
                       **({"max_running": max_running} if max_running is not None else {}))
    engine = Engine(cfg, sinks=[], trace=None)
    try:
        run_workload(engine, warm)
        seen["on"] = True
        fwd_ns[0] = 0
        run_workload(engine, items)
    finally:
        CausalLM.forward = inner  # type: ignore[method-assign]
        engine.close()
    return batches, seen["model"], seen["kv"], fwd_ns[0] / 1e9


# --------------------------------------------------------------------------- the timed mirror
class Clock:
    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t = time.perf_counter_ns()
        yield
        self.ns[name] += time.perf_counter_ns() - t


def timed_forward(model: CausalLM, fb: ForwardBatch, kv: PagedKVCache, c: Clock) -> tuple[torch.Tensor, torch.Tensor]:
    """`CausalLM.forward` (one rank, DecoderLayer.forward's fused-bias branch) and greedy
    sampling, part by part. Returns the logits and the tokens."""
    with c.part("embed"):
        x = model.embed(fb)
    with c.part("plan"):
        cos, sin, plan = model.attention_inputs(fb)
    for i, layer in enumerate(model.layers):
        kc, vc = kv.k[i], kv.v[i]
        with c.part("norm"):
            h = rms_norm(x, layer.input_layernorm, layer.eps)
        with c.part("qkv"):
            qkv = layer._linear(h, "qkv_proj", layer.qkv_proj, layer.qkv_bias)
        with c.part("rope_kv"):
            q, k, v = rope_store(qkv, layer.num_heads, layer.num_kv_heads, layer.head_dim, cos, sin, kc, vc,
                                 fb.slot_mapping)
        # layers.paged_attention in its two halves, timed apart: the decode rows read their
        # context (bytes), the prefill rows compute over theirs (FLOPs)
        with c.part("attn_decode"):
            dec = decode_attention(q, kc, vc, fb, plan)
        with c.part("attn_prefill"):
            a = join_rows(dec + prefill_attention(q, k, v, kc, vc, fb, plan))
        with c.part("o_proj"):
            o = layer._linear(a, "o_proj", layer.o_proj, layer.o_bias)
        with c.part("add_norm"):
            x, h = add_norm(x, o, layer.post_attention_layernorm, layer.eps)
        if fused_gating(model):  # the SiLU-gating inside the GEMM's pass: the part is gate_up's
            with c.part("gate_up"):
                m = layer.gated(h)
        else:
            with c.part("gate_up"):
                gu = layer._linear(h, "gate_up_proj", layer.gate_up_proj, layer.gate_up_bias)
            with c.part("act"):
                m = silu_gate(gu)
        with c.part("down"):
            d = layer._linear(m, "down_proj", layer.down_proj, layer.down_bias)
        with c.part("residual"):
            x = x + d
    with c.part("logits"):
        logits = model.compute_logits(x, fb)
    with c.part("sample"):
        tokens = greedy_pick(logits[: fb.num_sampled])
    return logits, tokens


def fused_gating(model: CausalLM) -> bool:
    """Whether the model's gate/up GEMM does the SiLU-gating in its own pass (packed_gemm.gated)."""
    packed = model.layers[0].packs.get("gate_up_proj")
    return packed is not None and packed_gemm.gates(packed)


# --------------------------------------------------------------------------- work per part
def work(model: CausalLM, fb: ForwardBatch) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) each part must do for this batch, at the least: no padding, each
    tensor read and written once, in the model's dtype (the logits and sampling in float32)."""
    cfg = model.cfg
    es = model.layers[0].input_layernorm.element_size()  # bytes per element of the model's dtype
    t, hs, inter, v = fb.num_tokens, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qs, kvs = h * d, kvh * d
    n_layers = len(model.layers)
    rows = fb.num_sampled + fb.num_scored
    nd = fb.num_decode
    dec_keys = int((fb.positions[:nd] + 1).sum()) if nd else 0  # a decode row attends its whole context
    pre_keys = pre_read = 0  # query-key pairs a prefill chunk attends (causal), and the tokens whose K/V it reads
    for p in fb.prefills:
        n = p.row_end - p.row_start
        pre_keys += n * p.start_pos + n * (n + 1) // 2
        pre_read += p.start_pos + n
    gemm = {"qkv": (hs, qs + 2 * kvs), "o_proj": (qs, hs), "gate_up": (hs, 2 * inter), "down": (inter, hs)}
    out: dict[str, tuple[float, float]] = {}
    for name, (k_in, n_out) in gemm.items():
        out[name] = (2.0 * t * k_in * n_out * n_layers, es * (t * k_in + k_in * n_out + t * n_out) * n_layers)
    out["logits"] = (2.0 * rows * hs * v, es * (rows * hs + hs * v) + F32 * rows * v)
    out["attn_decode"] = (4.0 * dec_keys * h * d * n_layers, es * (2 * dec_keys * kvs + 2 * nd * qs) * n_layers)
    out["attn_prefill"] = (4.0 * pre_keys * h * d * n_layers, es * (2 * pre_read * kvs + 2 * (t - nd) * qs) * n_layers)
    out["embed"] = (0.0, es * 2 * t * hs)
    out["norm"] = (0.0, es * 2 * t * hs * n_layers)  # the input norm; the other is add_norm's
    # reads q, k and v once; writes the rotated q in place and k and v to the cache (the
    # rotated k straight there: its in-place copy is not needed)
    out["rope_kv"] = (0.0, es * t * (2 * qs + 5 * kvs) * n_layers)
    out["add_norm"] = (0.0, es * 4 * t * hs * n_layers)  # reads x and the attention's output, writes the sum and its norm
    out["act"] = (0.0, es * 3 * t * inter * n_layers)
    if fused_gating(model):  # gate_up writes the gated [t, inter] rows; no pass of its own
        out["gate_up"] = (out["gate_up"][0], out["gate_up"][1] - es * t * inter * n_layers)
        out["act"] = (0.0, 0.0)
    out["residual"] = (0.0, es * 3 * t * hs * n_layers)  # the MLP's add
    out["sample"] = (0.0, F32 * fb.num_sampled * v)
    out["plan"] = (0.0, 0.0)
    return out


def shape_alone_s(model: CausalLM, fbs: list[ForwardBatch], reps: int) -> dict[str, float]:
    """Each GEMM part alone at the batches' own shapes (random inputs, the real weights, through
    the model's own GEMM: reordered where the run packed them), and the SiLU-gating where it is
    a pass of its own (`silu_gate`, as the layers run it, on a random gate/up output), best of
    `reps` per batch, summed: what the part costs with no neighbours."""
    lay = model.layers[0]
    cfg = model.cfg
    n_layers = len(model.layers)
    dtype = lay.input_layernorm.dtype
    fan_in = {"qkv_proj": cfg.hidden_size, "o_proj": cfg.q_size, "gate_up_proj": cfg.hidden_size,
              "down_proj": cfg.intermediate_size}
    total: dict[str, float] = defaultdict(float)
    fused = fused_gating(model)
    for fb in fbs:
        t = fb.num_tokens
        for part, name, b in (("qkv", "qkv_proj", lay.qkv_bias), ("o_proj", "o_proj", lay.o_bias),
                              ("gate_up", "gate_up_proj", lay.gate_up_bias), ("down", "down_proj", lay.down_bias)):
            x = torch.randn(t, fan_in[name], dtype=dtype)
            w = getattr(lay, name)
            if part == "gate_up" and fused:
                total[part] += n_layers * _best_s(lambda x=x: lay.gated(x), reps)
            else:
                total[part] += n_layers * _best_s(lambda x=x, n=name, w=w, b=b: lay._linear(x, n, w, b), reps)
        if not fused:
            gu = torch.randn(t, 2 * cfg.intermediate_size, dtype=dtype)
            total["act"] += n_layers * _best_s(lambda gu=gu: silu_gate(gu), reps)
        rows = fb.num_sampled + fb.num_scored
        if rows:
            x = torch.randn(rows, cfg.hidden_size, dtype=dtype)
            total["logits"] += _best_s(lambda x=x: model.head_gemm(x), reps)
    return dict(total)


# --------------------------------------------------------------------------- report
def measure(model: CausalLM, fbs: list[ForwardBatch], kv: PagedKVCache, reps: int) -> dict[str, Any]:
    """Per part: seconds in the mirror, FLOPs and bytes of its least work, and its GEMM alone
    at the batches' shapes; and the whole forward's own seconds."""
    c = Clock()
    whole_ns = native_ns = 0
    with torch.inference_mode():
        for i, fb in enumerate(fbs):
            # as the engine runs it (a decode round's layers in one C call), and with the layers
            # in Python (the forward the parts mirror); which goes first alternates
            for native in (True, False) if i % 2 == 0 else (False, True):
                with nullcontext() if native else python_layers():
                    t0 = time.perf_counter_ns()
                    logits = model.forward(fb, kv)
                    greedy_pick(logits[: fb.num_sampled])
                    dt = time.perf_counter_ns() - t0
                if native:
                    native_ns, out = native_ns + dt, logits
                else:
                    whole_ns, ref = whole_ns + dt, logits
            assert torch.equal(out, ref), "the layers in one C call drifted from the layers in Python"
            logits, _ = timed_forward(model, fb, kv, c)
            assert torch.equal(logits, ref), "the timed mirror drifted from CausalLM.forward"
        shape = shape_alone_s(model, fbs, reps)
    return {"batches": len(fbs), "tokens": sum(fb.num_tokens for fb in fbs),
            "decode_rows": sum(fb.num_decode for fb in fbs), "whole_s": whole_ns / 1e9, "native_s": native_ns / 1e9,
            "s": {p: c.ns.get(p, 0) / 1e9 for p in PARTS}, "work": [work(model, fb) for fb in fbs],
            "shape_s": {p: shape.get(p, 0.0) for p in PARTS}}


def pages_ab(model: CausalLM, fbs: list[ForwardBatch], kv: PagedKVCache, model_name: str) -> None:
    """The captured batches' forward three ways, in turn batch by batch (the order rotating),
    the logits checked equal: the engine's model and KV pool as the engine laid them out
    (on 2 MB pages where the kernel lent them: huge_pages), the same model on a copy of the
    pool on 4 KB pages, and a second copy of the model loaded without the weights' advice on
    that copy. What the pool's pages and the weights' are worth to the forward, the rounds
    split as in the tables. A replayed batch writes the same K/V to the same slots in either
    pool, so they stay equal. On a host whose transparent huge pages are `always` (or with
    torch's THP_MEM_ALLOC_ENABLE) the second model's weights may land on huge pages anyway:
    the counts printed first say how each lies."""
    small = copy.copy(kv)
    small._pool, _ = huge_pages.empty(tuple(kv._pool.shape), kv._pool.dtype, huge=False)
    small._pool.copy_(kv._pool)
    small.k = [small._pool[i, 0] for i in range(kv.num_layers)]
    small.v = [small._pool[i, 1] for i in range(kv.num_layers)]
    advise, huge_pages.advise = huge_pages.advise, lambda spans: 0
    try:  # the weights where the allocator put them, as before 2026-12-07
        plain, _ = load_model(resolve_model(model_name), "cpu", kv.dtype, pack=bool(model.layers[0].packs))
    finally:
        huge_pages.advise = advise
    for name, held in (("the engine's KV pool", kv._pool), ("its copy", small._pool),
                       ("the engine's weights", model.weight_spans()), ("the second model's", plain.weight_spans())):
        on, mapped = huge_pages.backed(held)
        print(f"{name}: the mappings holding it {on / 2**20:.0f} MB on 2 MB pages of {mapped / 2**20:.0f} MB "
              f"(transparent huge pages: {huge_pages.mode()})")
    arms = (("as the engine lays them", model, kv), ("the pool on 4 KB pages", model, small),
            ("the weights and the pool on 4 KB pages", plain, small))
    ns: dict[tuple[str, int], int] = defaultdict(int)
    with torch.inference_mode():
        for i, fb in enumerate(fbs):
            kind = "prefill-heavy" if fb.num_tokens - fb.num_decode >= fb.num_decode else "decode-heavy"
            out = {}
            for a in range(3):
                arm = (a + i) % 3
                _, m, pool = arms[arm]
                t0 = time.perf_counter_ns()
                out[arm] = m.forward(fb, pool)
                ns[kind, arm] += time.perf_counter_ns() - t0
            assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2]), "the layouts' forwards differ"
    for kind in ("prefill-heavy", "decode-heavy", "whole run"):
        ms = [sum(v for (k, arm), v in ns.items() if arm == a and kind in (k, "whole run")) / 1e6 for a in range(3)]
        if ms[2]:  # a load with no batches of one kind (no decode rows at all) has no line for it
            print(f"{kind}: " + "; ".join(f"{arms[a][0]} {ms[a]:.1f} ms ({ms[a] / ms[2]:.3f}x)" for a in range(3)))


def combined(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {k: a[k] + b[k] for k in ("batches", "tokens", "decode_rows", "whole_s", "native_s", "work")}
    return out | {k: {p: a[k][p] + b[k][p] for p in PARTS} for k in ("s", "shape_s")}


def table(name: str, m: dict[str, Any], peak: float, bw: float) -> dict[str, Any]:
    """The roofline rows of one set of batches, sorted by the time each part loses."""
    whole_s = m["whole_s"]
    rows = []
    for p in PARTS:
        s = m["s"][p]
        flops, nbytes = sum(w[p][0] for w in m["work"]), sum(w[p][1] for w in m["work"])
        # a roofline, batch by batch: the part can go no faster than its FLOPs at the GEMM peak,
        # nor than its bytes at the memory bandwidth (small GEMMs read more weight than they
        # compute). Summed over batches: the larger of the two totals would let a decode
        # round's bytes hide behind a prefill round's FLOPs, which no forward does
        limit = sum(max(w[p][0] / (peak * 1e9), w[p][1] / (bw * 1e9)) for w in m["work"])
        rows.append({"part": p, "ms": s * 1e3, "share": s / whole_s if whole_s else 0.0,
                     "limit_ms": limit * 1e3, "of_limit": limit / s if s else None, "lost_ms": (s - limit) * 1e3,
                     "gflops": flops / s / 1e9 if s and flops else None,
                     "gbs": nbytes / s / 1e9 if s and p in BYTES_PARTS else None,
                     "shape_ms": m["shape_s"][p] * 1e3 if p in ALONE and m["shape_s"][p] else None})
    rows.sort(key=lambda r: -r["lost_ms"])
    total_flops = sum(f for w in m["work"] for f, _ in w.values())
    timed_s = sum(m["s"].values())
    limits_s = sum(r["limit_ms"] for r in rows) / 1e3
    return {"name": name, "batches": m["batches"], "tokens": m["tokens"], "decode_rows": m["decode_rows"],
            "forward_ms": whole_s * 1e3, "parts_ms": timed_s * 1e3, "unattributed_ms": (whole_s - timed_s) * 1e3,
            "native_forward_ms": m["native_s"] * 1e3,
            "gflops": total_flops / whole_s / 1e9 if whole_s else 0.0,
            "of_peak": total_flops / whole_s / 1e9 / peak if whole_s else 0.0,
            # the share of the peak a forward with every part exactly at its limit would reach
            "at_limits_of_peak": total_flops / limits_s / 1e9 / peak if limits_s else 0.0, "parts": rows}


def print_table(t: dict[str, Any]) -> None:
    print(f"\n{t['name']}: {t['batches']} batches, {t['tokens']} tokens ({t['decode_rows']} decode rows); "
          f"forward {t['forward_ms']:.1f} ms, {t['gflops']:.1f} GFLOP/s = {t['of_peak']:.1%} of the GEMM peak "
          f"(every part at its limit: {t['at_limits_of_peak']:.1%})")
    print(f"{'part':<12} {'ms':>9} {'share':>6} {'limit ms':>9} {'of limit':>8} {'lost ms':>9} "
          f"{'GFLOP/s':>8} {'GB/s':>6} {'shape ms':>9}")
    for r in t["parts"]:
        def f(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)
        print(f"{r['part']:<12} {r['ms']:9.1f} {r['share']:6.1%} {r['limit_ms']:9.1f} {f(r['of_limit'], '8.1%')} "
              f"{r['lost_ms']:9.1f} {f(r['gflops'], '8.1f')} {f(r['gbs'], '6.1f')} {f(r['shape_ms'], '9.1f')}")
    print(f"{'unattributed':<12} {t['unattributed_ms']:9.1f} {t['unattributed_ms'] / t['forward_ms']:6.1%}")
    print(f"the forward as the engine runs it, a decode round's layers in one C call where that applies "
          f"(native_layers): {t['native_forward_ms']:.1f} ms, {t['native_forward_ms'] / t['forward_ms']:.3f}x "
          "the forward above (the layers in Python, which the parts mirror)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=parse_range, default=(16, 512), metavar="MIN-MAX")
    ap.add_argument("--output-len", type=parse_range, default=(16, 256), metavar="MIN-MAX")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="best of this many for each same-shape GEMM")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--gather", action="store_true",
                    help="decode attention by gather + SDPA, as without the C extension (an A/B of it)")
    ap.add_argument("--attention-lib", type=Path, default=None,
                    help="decode attention from this build of _attention.c (an A/B of two builds)")
    ap.add_argument("--prefill-sdpa", action="store_true",
                    help="prefill attention by SDPA per chunk, as without the C extension (an A/B of it)")
    ap.add_argument("--torch-gating", action="store_true",
                    help="the MLP's SiLU-gating by torch's two ops, as where torch runs neither AVX-512 kernels nor, "
                         "in float32, AVX2 ones (an A/B of the C pass)")
    ap.add_argument("--torch-argmax", action="store_true",
                    help="the greedy pick by torch's argmax, as off the CPU (an A/B of the C pass)")
    ap.add_argument("--capture-only", action="store_true", help="only the engine run: its forward time")
    ap.add_argument("--pages-ab", action="store_true",
                    help="only the engine run, then its batches' forward with the weights and KV pool as the "
                         "engine laid them (2 MB pages where the kernel lends them), the pool on 4 KB pages, and "
                         "both on 4 KB pages, in turn")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the engine's dtype; the GEMM peak is measured in it and the bytes counted in it")
    ap.add_argument("--max-running", type=int, default=None,
                    help="the engine's --max-running (its default: 256): a serving load's batch size")
    ap.add_argument("--weight-pack", choices=("auto", "on", "off"), default="auto",
                    help="the engine's --weight-pack (its default: auto, measured at start)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from scheduler.model import native_attention

    if args.gather:
        native_attention._LIB = None  # what an install without a C compiler runs
    elif args.attention_lib is not None:
        native_attention._LIB = native_attention.load_library(args.attention_lib)
        if native_attention._LIB is None:
            ap.error(f"--attention-lib {args.attention_lib}: not a loadable build")
    if args.prefill_sdpa:
        native_attention._PREFILL = None
    if args.torch_gating:
        native_elementwise.EXPF16 = native_elementwise.EXPF8 = None
    if args.torch_argmax:
        native_elementwise.argmax = lambda x: None  # sampling.greedy_pick then runs torch's
    if args.capture_only:
        fbs, _, _, run_fwd_s = capture(args.model, args.requests, args.prompt_len, args.output_len, args.seed,
                                       args.weight_pack, args.dtype, args.max_running)
        label = "gather" if args.gather else str(args.attention_lib or "default")
        label += ", prefill by SDPA" if args.prefill_sdpa else ""
        label += ", torch's gating" if args.torch_gating else ""
        label += ", torch's argmax" if args.torch_argmax else ""
        print(f"the engine's forward took {run_fwd_s:.2f} s in the run ({label}); {block_runs(fbs)}")
        return 0
    if args.pages_ab:
        fbs, model, kv, _ = capture(args.model, args.requests, args.prompt_len, args.output_len, args.seed,
                                    args.weight_pack, args.dtype, args.max_running)
        pages_ab(model, fbs, kv, args.model)
        return 0
    started = datetime.now(UTC)
    load_before = load()
    dtype = getattr(torch, args.dtype)
    peaks = peak_gflops(dtype)
    bw = bandwidth_gbs()
    print(f"{args.threads} thread(s), {args.dtype}: GEMM peak {max(peaks.values()):.1f} GFLOP/s "
          f"({', '.join(f'{k}: {v:.0f}' for k, v in peaks.items())}), copy bandwidth {bw:.1f} GB/s; load {load_before}")
    fbs, model, kv, run_fwd_s = capture(args.model, args.requests, args.prompt_len, args.output_len, args.seed,
                                        args.weight_pack, args.dtype, args.max_running)
    packed = bool(model.layers[0].packs)
    print(f"captured {len(fbs)} batches; the engine's forward took {run_fwd_s:.2f} s in the run; "
          f"weights reordered (--weight-pack {args.weight_pack}): {'yes' if packed else 'no'}; {block_runs(fbs)}")
    prefill_heavy = [fb for fb in fbs if fb.num_tokens - fb.num_decode >= fb.num_decode]
    decode_heavy = [fb for fb in fbs if fb.num_tokens - fb.num_decode < fb.num_decode]
    pre, dec = measure(model, prefill_heavy, kv, args.reps), measure(model, decode_heavy, kv, args.reps)
    # measured again after the replay, the higher of the two kept: a shared machine's speed moves
    # within minutes, and a peak caught in a slow phase would flatter the forward's share of it
    peaks_after, bw_after = peak_gflops(dtype), bandwidth_gbs()
    peak, bw_used = max(*peaks.values(), *peaks_after.values()), max(bw, bw_after)
    print(f"GEMM peak after the replay {max(peaks_after.values()):.1f} GFLOP/s, copy bandwidth {bw_after:.1f} GB/s; "
          f"the tables use {peak:.1f} and {bw_used:.1f}")
    tables = [table("whole run", combined(pre, dec), peak, bw_used),
              table("prefill-heavy rounds", pre, peak, bw_used), table("decode-heavy rounds", dec, peak, bw_used)]
    for t in tables:
        print_table(t)
    print(f"\nmedian batch: {statistics.median(fb.num_tokens for fb in fbs)} tokens; load {load()}")
    out = args.out or OUT / f"forward-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "forward", "command": " ".join(["bench/bench_forward.py", *sys.argv[1:]]),
                               "started_utc": started.isoformat(timespec="seconds"), "threads": args.threads,
                               "peak_gflops": peaks, "peak_gflops_after": peaks_after, "peak_used_gflops": peak,
                               "bandwidth_gbs": bw, "bandwidth_gbs_after": bw_after, "bandwidth_used_gbs": bw_used,
                               "load_before": load_before,
                               "run_forward_s": run_fwd_s, "dtype": args.dtype, "max_running": args.max_running,
                               "weight_pack": args.weight_pack,
                               "weights_reordered": packed, "tables": tables}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
