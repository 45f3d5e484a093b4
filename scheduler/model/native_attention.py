"""Attention on the paged KV cache in C, loaded with ctypes where the install built it: decode
rows (`_attention.c`) and prefill chunks (`_prefill_attention.c`, `prefill` below).

`decode` reads each decode row's context once, through its block table, where it lies
in the cache: no gathered copy (see the C file for why). It takes float32 or bfloat16
tensors on the CPU only (bfloat16 computed in float32, the output rounded once); anything
else, or an install without a C compiler, returns None and `layers.paged_attention`
gathers and runs SDPA as before, which gives the same values up to the dtype's rounding.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

import torch

_P = ctypes.c_void_p
_N = ctypes.c_int64


def open_library(stem: str, path: Path | None = None) -> ctypes.CDLL | None:
    """The model's extension `stem` as the install built it next to this file, or the build
    at `path`, opened with ctypes; None where there is none, or a stale or foreign one (the
    torch path then, not a failed import)."""
    here = Path(__file__).parent
    paths = [path] if path is not None else [here / f"{stem}{s}" for s in importlib.machinery.EXTENSION_SUFFIXES]
    for p in paths:
        if p.is_file():
            try:
                return ctypes.CDLL(str(p))
            except OSError:
                return None
    return None


def load_library(path: Path | None = None) -> ctypes.CDLL | None:
    """The installed build, or the one at `path` (bench/bench_forward.py's A/B of two builds)."""
    lib = open_library("_attention", path)
    if lib is not None:
        for name in ("decode_attention", "decode_attention_bf16"):
            if hasattr(lib, name):  # an older build (`path`) has no bfloat16 entry
                fn = getattr(lib, name)
                fn.argtypes = [_P, _N, _P, _P, _P, _N, _P, _N, _N, _N, _N, _N, _N, ctypes.c_float, _P, _N]
                fn.restype = ctypes.c_int
    return lib


def max_head_dim(lib: ctypes.CDLL | None) -> int:
    """The largest head size the library takes (_attention.c's MAX_HEAD_DIM: its row sums
    hold that many values); 0 without one, or for a build from before the limit was exported
    (an in-place build left behind: the torch path, not a failed import)."""
    try:
        return int(ctypes.c_int64.in_dll(lib, "attention_max_head_dim").value) if lib is not None else 0
    except ValueError:  # ctypes: no such symbol
        return 0


_LIB = load_library()
MAX_HEAD_DIM = max_head_dim(_LIB)
_LIB = _LIB if MAX_HEAD_DIM else None
AVAILABLE = _LIB is not None
# the C entry point for each dtype it takes
_ENTRIES = {torch.float32: "decode_attention", torch.bfloat16: "decode_attention_bf16"}


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
           ctx_lens: torch.Tensor, block_size: int, window: int | None) -> torch.Tensor | None:
    """q [rows, H, D] (rows may be strided), caches [slots, KVH, D], blocks [rows, nblk] int64,
    ctx_lens [rows] int64 (the new token included) -> [rows, H * D]; None where the C path
    does not apply. The tables are trusted to cover each row's context with blocks of the
    cache, as `build_forward_batch` checks when it makes them."""
    rows = q.shape[0]
    entry = _ENTRIES.get(q.dtype)
    tensors_fit = (q.device.type == k_cache.device.type == v_cache.device.type == blocks.device.type
                   == ctx_lens.device.type == "cpu"
                   and q.dtype == k_cache.dtype == v_cache.dtype
                   and blocks.dtype == ctx_lens.dtype == torch.int64
                   and q.dim() == k_cache.dim() == 3 and k_cache.shape == v_cache.shape
                   and k_cache.shape[2] == q.shape[2] <= MAX_HEAD_DIM and k_cache.shape[1] > 0
                   and blocks.dim() == 2 and blocks.shape[0] >= rows and ctx_lens.numel() >= rows
                   and q.stride(2) == 1 and q.stride(1) == q.shape[2]
                   and k_cache.is_contiguous() and v_cache.is_contiguous())
    if _LIB is None or entry is None or not hasattr(_LIB, entry) or not tensors_fit:
        return None
    _, heads, d = q.shape
    kvh = k_cache.shape[1]
    blocks = blocks.contiguous()
    ctx_lens = ctx_lens.contiguous()
    out = torch.empty(rows, heads * d, dtype=q.dtype)
    status = getattr(_LIB, entry)(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                  blocks.data_ptr(), blocks.shape[1], ctx_lens.data_ptr(), rows, heads, kvh, d,
                                  block_size, window or 0, d ** -0.5, out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


def _load_prefill(path: Path | None = None) -> ctypes.CDLL | None:
    lib = open_library("_prefill_attention", path)
    if lib is None or not hasattr(lib, "prefill_attention"):
        return None
    lib.prefill_attention.argtypes = [_P, _N, _P, _P, _P, _P, _N, _N, _N, _N, _N, ctypes.c_float, _P, _N, _N, _N]
    lib.prefill_attention.restype = ctypes.c_int
    lib.prefill_attention_runs.argtypes = [_N]
    lib.prefill_attention_runs.restype = ctypes.c_int
    return lib


_PREFILL = _load_prefill()
PREFILL_AVAILABLE = _PREFILL is not None
PREFILL_MAX_HEAD_DIM = int(ctypes.c_int64.in_dll(_PREFILL, "prefill_attention_max_head_dim").value) if _PREFILL else 0
_PREFILL_DTYPES = (torch.float32, torch.bfloat16)
# _prefill_attention.c's builds by name (`isa`): the best this CPU runs, or one of them
PREFILL_ISAS = {"auto": -1, "avx512": 2, "avx2": 1, "baseline": 0}


def prefill_runs(isa: str) -> bool:
    """Whether this CPU runs the build `isa` names (PREFILL_ISAS)."""
    return _PREFILL is not None and bool(_PREFILL.prefill_attention_runs(PREFILL_ISAS[isa]))


# whether this CPU runs a build the engine picks: asked once, not on every forward
_PREFILL_AUTO = prefill_runs("auto")


def prefill_takes(dtype: torch.dtype, device: torch.device, head_dim: int | None = None) -> bool:
    """Whether `prefill` runs a batch of this dtype on this device: float32 or bfloat16 on a CPU
    with AVX2 and FMA at least (its baseline build is slower than SDPA), heads a multiple of 8 up
    to PREFILL_MAX_HEAD_DIM (where `head_dim` is given; else the call itself refuses others)."""
    return (dtype in _PREFILL_DTYPES and device.type == "cpu" and _PREFILL is not None and _PREFILL_AUTO
            and (head_dim is None or (head_dim % 8 == 0 and head_dim <= PREFILL_MAX_HEAD_DIM)))


def prefill_keys(prefills: list[tuple[int, int, int, torch.Tensor | None]], slot_mapping: torch.Tensor,
                 num_decode: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `prefill` reads each chunk's keys by, made once a forward: the cache slots of every
    chunk's keys (positions 0 .. start + n - 1, concatenated) and a [chunks, 5] table of
    (first q row, n, start, first slot index, first output row). A chunk is (first row, n,
    start, the blocks of its context or None where it starts at 0: its own new slots)."""
    pieces: list[torch.Tensor] = []
    meta: list[list[int]] = []
    at = 0
    for row0, n, start, ctx_blocks in prefills:
        if ctx_blocks is None:
            keys = slot_mapping[row0 : row0 + n]
        else:
            offs = torch.arange(block_size, dtype=torch.int64, device=ctx_blocks.device)
            keys = (ctx_blocks[:, None] * block_size + offs).reshape(-1)[: start + n]
        meta.append([row0, n, start, at, row0 - num_decode])
        pieces.append(keys)
        at += start + n
    slots = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    return slots.contiguous(), torch.tensor(meta, dtype=torch.int64).reshape(-1, 5)


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, meta: torch.Tensor,
            rows: int, window: int | None, isa: str = "auto") -> torch.Tensor | None:
    """Causal attention of every prefill chunk (`prefill_keys`' tables) over its keys in the
    caches (its own K/V already stored there): q [T, H, D] (rows may be strided) ->
    [rows, H * D], the chunks' output rows. None where the C path does not apply (float32 or
    bfloat16 on the CPU only; bfloat16 computed in float32, the output rounded once); the caller
    then runs SDPA, which gives the same values up to the dtype's rounding."""
    tensors_fit = (q.device.type == k_cache.device.type == v_cache.device.type == slots.device.type == "cpu"
                   and q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in _PREFILL_DTYPES
                   and slots.dtype == meta.dtype == torch.int64 and meta.dim() == 2 and meta.shape[1] == 5
                   and q.dim() == k_cache.dim() == 3 and k_cache.shape == v_cache.shape
                   and k_cache.shape[2] == q.shape[2] and q.stride(2) == 1 and q.stride(1) == q.shape[2]
                   and k_cache.is_contiguous() and v_cache.is_contiguous())
    if _PREFILL is None or not tensors_fit:
        return None
    _, heads, d = q.shape
    out = torch.empty(rows, heads * d, dtype=q.dtype)
    slots, meta = slots.contiguous(), meta.contiguous()
    status = _PREFILL.prefill_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                        slots.data_ptr(), meta.data_ptr(), meta.shape[0], heads, k_cache.shape[1], d,
                                        window or 0, d ** -0.5, out.data_ptr(), torch.get_num_threads(),
                                        PREFILL_ISAS[isa], q.dtype == torch.bfloat16)
    return out if status == 0 else None
