"""Load an HF safetensors checkpoint into :class:`CausalLM`, tensor by tensor.

Each HF tensor is mapped to a :class:`WeightTarget` (an engine parameter plus a row range inside
it, because q/k/v and gate/up are fused).  Tensors stream one at a time from ``safe_open`` through
``shard_fn`` into their slice, so peak extra memory is one tensor and a tensor-parallel loader can
slice each tensor (``shard_fn``) while the model allocates per-rank shapes (``cfg``).  A pipeline
stage loads only its :class:`ModelPart`; tensors of other stages are skipped unread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from . import huge_pages, packed_gemm
from .config import ModelConfig, ModelLoadError, ModelPart
from .layers import AllReduceFn
from .transformer import CausalLM

# (hf_name, tensor) -> the part of the tensor this process keeps; identity without TP.
ShardFn = Callable[[str, torch.Tensor], torch.Tensor]

# Tensors some exporters write that the engine recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True, frozen=True)
class WeightTarget:
    param: str  # dotted engine parameter name, e.g. "layers.3.qkv_proj"
    row_offset: int  # first row (dim 0) of the slice this tensor fills
    rows: int  # number of rows it fills


def weight_targets(cfg: ModelConfig, part: ModelPart | None = None) -> dict[str, WeightTarget]:
    """HF tensor name -> engine destination, for every tensor ``part`` (default: the whole
    model) must be given.  Row counts follow ``cfg``, i.e. per-rank shapes under TP."""
    part = part or ModelPart.whole(cfg)
    qs, kvs, inter, hs = cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.hidden_size
    out: dict[str, WeightTarget] = {}
    vocab = cfg.vocab_size
    if part.embed:
        out["model.embed_tokens.weight"] = WeightTarget("embed_tokens", 0, vocab)
    if part.head:
        out["model.norm.weight"] = WeightTarget("norm", 0, hs)
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = WeightTarget("lm_head", 0, vocab)
        elif not part.embed:  # tied, but the embedding is not here: the head gets its own copy
            out["model.embed_tokens.weight"] = WeightTarget("lm_head", 0, vocab)
    fused = (("q", 0, qs), ("k", qs, kvs), ("v", qs + kvs, kvs))
    for i in part.layers:
        hf, me = f"model.layers.{i}.", f"layers.{i - part.first_layer}."
        out[hf + "input_layernorm.weight"] = WeightTarget(me + "input_layernorm", 0, hs)
        out[hf + "post_attention_layernorm.weight"] = WeightTarget(
            me + "post_attention_layernorm", 0, hs
        )
        for name, off, rows in fused:
            out[f"{hf}self_attn.{name}_proj.weight"] = WeightTarget(me + "qkv_proj", off, rows)
            if cfg.attention_bias:
                out[f"{hf}self_attn.{name}_proj.bias"] = WeightTarget(me + "qkv_bias", off, rows)
        out[hf + "self_attn.o_proj.weight"] = WeightTarget(me + "o_proj", 0, hs)
        if cfg.o_proj_bias:
            out[hf + "self_attn.o_proj.bias"] = WeightTarget(me + "o_bias", 0, hs)
        for name, off in (("gate", 0), ("up", inter)):
            out[f"{hf}mlp.{name}_proj.weight"] = WeightTarget(me + "gate_up_proj", off, inter)
            if cfg.mlp_bias:
                out[f"{hf}mlp.{name}_proj.bias"] = WeightTarget(me + "gate_up_bias", off, inter)
        out[hf + "mlp.down_proj.weight"] = WeightTarget(me + "down_proj", 0, hs)
        if cfg.mlp_bias:
            out[hf + "mlp.down_proj.bias"] = WeightTarget(me + "down_bias", 0, hs)
    return out


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"bad safetensors index {index}: {e!r}") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    if (single := model_dir / "model.safetensors").is_file():
        return [single]  # transformers' own order: a LoRA adapter or consolidated copy beside it is not the model
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def default_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    # CPU half-precision GEMMs are slow and inexact; accelerators run the checkpoint's dtype.
    return torch.float32 if device.type == "cpu" else cfg.torch_dtype


def load_model(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    shard_fn: ShardFn | None = None,
    *,
    cfg: ModelConfig | None = None,
    part: ModelPart | None = None,
    all_reduce: AllReduceFn | None = None,
    pack: bool = False,
) -> tuple[CausalLM, ModelConfig]:
    """Build a :class:`CausalLM` from an HF checkpoint folder (config.json + safetensors).

    The keyword arguments are for ``scheduler.parallel``: ``cfg`` replaces the folder's config
    for allocation (per-rank shapes; ``shard_fn`` must slice to them), ``part`` selects a
    pipeline stage, ``all_reduce`` is the layers' TP hook.  ``pack``: the projections' weights
    reordered for the CPU's GEMM (scheduler.model.packed_gemm; ``choose_pack`` decides).
    Returns the config the model uses.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder not found: {model_dir}")
    if cfg is None:
        cfg = ModelConfig.from_file(model_dir / "config.json")
    files = safetensors_files(model_dir)
    device = torch.device(device)
    dtype = dtype or default_dtype(cfg, device)
    packed_gemm.size_primitive_cache()  # a device process or TP rank: before its first GEMM

    model = CausalLM(cfg, dtype=dtype, device=device, part=part, all_reduce=all_reduce)
    params = dict(model.named_parameters(remove_duplicate=False))
    targets = weight_targets(cfg, model.part)
    # Names of the whole model: another stage's tensor is skipped, an unknown one is an error.
    known = targets.keys() | weight_targets(cfg).keys()
    filled: set[str] = set()
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot open {path}: {e}") from None
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                target = targets.get(name)
                if target is None:
                    if (
                        name in known
                        or name.endswith(_IGNORED_SUFFIXES)
                        or (name == "lm_head.weight" and cfg.tie_word_embeddings)
                    ):
                        continue
                    raise ModelLoadError(
                        f"unexpected tensor {name!r} in {path.name} for {cfg.architecture}"
                    )
                tensor = f.get_tensor(name)
                if shard_fn is not None:
                    tensor = shard_fn(name, tensor)
                dest = params[target.param].data[
                    target.row_offset : target.row_offset + target.rows
                ]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                filled.add(name)
    missing = [n for n in targets if n not in filled]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"checkpoint {model_dir} is missing tensor {missing[0]!r}{more}")
    model.eval()
    if pack:
        model.pack_weights()
    if model.device.type == "cpu":  # each round streams them: on 2 MB pages where the kernel lends them
        model.weights_collapsed = huge_pages.advise(model.weight_spans())
    return model, cfg
