"""A decode round's decoder layers in one C call (`_decode_layers.c`), where every kernel a
layer calls has a C build here: bfloat16 projections on AMX tiles with the MLP's gating in
their pass (packed_gemm), the C norms and RoPE with the KV write (native_elementwise), and the
C decode attention (native_attention).

Why: a decode round's layer is nine calls from Python into those kernels, and on a 16-row
round each call's own cost (the interpreter, argument checks, ctypes, an output tensor,
all slower right after a GEMM has streamed its weights through the caches) was a large part
of the round (BENCHMARKS.md, "A decode round's layers in one call"). The C loop calls the
same kernels in the same order on the same bits, so its output and KV cache are the Python
layers' bit for bit (a NaN's encoding aside: torch itself writes two; tests/test_native_layers.py).
Everything else runs the layers in Python: rounds with prefill rows, float32, a tensor-parallel
rank (its layers all-reduce), a missing build. A pipeline stage without tensor parallelism runs
its own layers through the call like a whole model.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from scheduler.model import native_attention, native_elementwise, packed_gemm
from scheduler.model.native_attention import open_library

if TYPE_CHECKING:
    from scheduler.model.forward_batch import ForwardBatch
    from scheduler.model.kv_cache import PagedKVCache
    from scheduler.model.transformer import CausalLM

_P = ctypes.c_void_p
_N = ctypes.c_int64


class _Kernels(ctypes.Structure):
    """`Kernels` of _decode_layers.c: the addresses of the kernels it chains."""

    _fields_ = [(name, _P) for name in ("linear", "gated", "rms_norm", "add_rms_norm", "rope_kv", "attention",
                                        "expf16")]


def _load() -> ctypes.CDLL | None:
    lib = open_library("_decode_layers")
    if lib is None or not hasattr(lib, "decode_layers"):
        return None
    lib.decode_layers.argtypes = [_P, _P, _N, _P, ctypes.c_float, _P, _P, _N, _P, _P, _P, _P, _P, _N, _N]
    lib.decode_layers.restype = ctypes.c_int
    return lib


_LIB = _load()
# the kernels' struct, rebuilt where one of its sources changed (a test or a bench swapping a build)
_CACHED: dict[str, Any] = {}
PER_LAYER = ("input_layernorm", "qkv_proj", "qkv_bias", "o_proj", "o_bias", "post_attention_layernorm",
             "gate_up_proj", "gate_up_bias", "down_proj", "down_bias")


def _address(fn: Any) -> int | None:
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def _kernels() -> _Kernels | None:
    """The kernels' addresses from the loaded builds; None where one is missing."""
    sources = (packed_gemm._AMX, packed_gemm._EXPF16, native_elementwise._LIB, native_attention._LIB)
    cached = _CACHED.get("sources")
    if cached is None or any(a is not b for a, b in zip(cached, sources, strict=True)):
        amx, exp, ew, attn = sources
        fns = None
        if amx is not None and exp is not None and ew is not None and attn is not None:
            fns = (amx.amx_linear, amx.amx_gated, native_elementwise._FNS.get(("rms_norm", "_bf16")),
                   native_elementwise._FNS.get(("add_rms_norm", "_bf16")),
                   native_elementwise._FNS.get(("rope_kv", "_bf16")), getattr(attn, "decode_attention_bf16", None))
        addrs = None if fns is None or any(f is None for f in fns) else [_address(f) for f in fns]
        _CACHED.update(sources=sources, kernels=None if addrs is None else _Kernels(*addrs, exp))
    kernels: _Kernels | None = _CACHED["kernels"]
    return kernels


@dataclass(frozen=True, slots=True)
class DecodeWeights:
    """Each layer's weights for the C call: their addresses, and the tensors themselves, held so
    the addresses stay theirs. Made by `pack_weights`, as the packs are: a weight changed after
    it is not seen here (nor by the packs)."""

    table: torch.Tensor  # [layers, 10] int64, PER_LAYER's order, 0 for an absent bias
    held: tuple[torch.Tensor, ...]


def weights_table(model: CausalLM) -> DecodeWeights | None:
    """Each layer's norms, packed projections and biases for `_decode_layers.c`; None where a
    layer's projections are not all on the AMX layout at the model's shapes with the gating in
    the gate/up pass, or it all-reduces (tensor parallel)."""
    cfg = model.cfg
    hs, inter = cfg.hidden_size, cfg.intermediate_size
    qs, qkvw = cfg.num_attention_heads * cfg.head_dim, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    shapes = {"qkv_proj": (qkvw, hs), "o_proj": (hs, qs), "gate_up_proj": (2 * inter, hs), "down_proj": (hs, inter)}
    # the norms' and biases' lengths: each is read as that many bfloat16 values
    lengths = {"input_layernorm": hs, "post_attention_layernorm": hs, "qkv_bias": qkvw, "o_bias": hs,
               "gate_up_bias": 2 * inter, "down_bias": hs}
    if cfg.head_dim > native_attention.MAX_HEAD_DIM:  # the attention would refuse every round, after layer 0's work
        return None
    rows: list[list[int]] = []
    held: list[torch.Tensor] = []
    for layer in model.layers:
        packs = layer.packs
        if (layer.all_reduce is not None or set(packs) != set(shapes)
                or any(p.dim() != 4 or (p.shape[0] * 16, p.shape[1] * 32) != shapes[n] for n, p in packs.items())
                or not packed_gemm.gates(packs["gate_up_proj"])):
            return None
        row: list[int] = []
        for name in PER_LAYER:
            t = packs.get(name, getattr(layer, name))
            if t is not None and name in lengths and not (t.dtype == torch.bfloat16 and t.is_contiguous()
                                                          and tuple(t.shape) == (lengths[name],)):
                return None
            if t is not None:
                held.append(t.detach())  # its storage, whatever later becomes of the parameter
            row.append(0 if t is None else t.data_ptr())
        rows.append(row)
    return DecodeWeights(torch.tensor(rows, dtype=torch.int64), tuple(held))


def decode_layers(model: CausalLM, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache,
                  weights: DecodeWeights) -> torch.Tensor | None:
    """The model's decoder layers over the embedded rows `x` [T, hidden] of a decode-only batch,
    in one C call; None where the call does not apply (the caller runs the layers in Python)."""
    kernels = _kernels()
    cfg = model.cfg
    # each layer's K and V are views of the cache's one contiguous pool: its own sizes say theirs
    if (_LIB is None or kernels is None or batch.num_decode != batch.num_tokens or batch.prefills
            or batch.decode_blocks is None or x.dtype != torch.bfloat16 or not x.is_contiguous()
            or x.shape != (batch.num_tokens, cfg.hidden_size)
            or kv.dtype != torch.bfloat16 or kv.device.type != "cpu"
            or (kv.num_kv_heads, kv.head_dim) != (cfg.num_key_value_heads, cfg.head_dim)):
        return None
    window = cfg.sliding_window if cfg.sliding_window is not None and batch.max_context_len > cfg.sliding_window else 0
    cos, sin = model.rope.tables(batch.max_context_len)  # held through the call: a grown table replaces it
    caches = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(kv.k, kv.v, strict=True)], dtype=torch.int64)
    table = torch.cat((weights.table, caches), dim=1)
    dims = torch.tensor([cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size, batch.block_size, kv.k[0].shape[0], torch.get_num_threads(),
                         cos.shape[0]], dtype=torch.int64)
    positions, slots = batch.positions.contiguous(), batch.slot_mapping.contiguous()
    blocks = batch.decode_blocks.contiguous()
    out = torch.empty_like(x)
    status = _LIB.decode_layers(ctypes.byref(kernels), table.data_ptr(), table.shape[0], dims.data_ptr(),
                                cfg.rms_norm_eps, x.data_ptr(), out.data_ptr(), x.shape[0], cos.data_ptr(),
                                sin.data_ptr(), positions.data_ptr(), slots.data_ptr(), blocks.data_ptr(),
                                blocks.shape[1], window)
    return out if status == 0 else None
