"""Model configuration parsed from a Hugging Face ``config.json``.

Only the fields the engine's own forward needs are kept; everything is validated up front so an
unsupported checkpoint fails at load time with one readable line instead of producing wrong tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scheduler.model.dtypes import dtype_of

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)

# Some hand-written configs carry only model_type.
_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded by the engine (missing files, unsupported model, bad weights)."""


@dataclass(slots=True)
class RopeScaling:
    """Llama-3 style frequency scaling; ``None`` on :class:`ModelConfig` means plain RoPE."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    # q/k/v bias and o_proj bias are separate because Qwen2 has the former without the latter.
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    max_position_embeddings: int
    eos_token_id: list[int]
    bos_token_id: int | None
    torch_dtype: torch.dtype

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        model_type = str(raw.get("model_type", "<none>"))
        arch = archs[0] if archs else _BY_MODEL_TYPE.get(model_type, model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            return cls._parse(arch, raw)
        except KeyError as e:
            raise ModelLoadError(f"config.json for {arch} is missing required field {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"config.json not found: {path}")
        cfg = cls.from_dict(_json_object(path))
        # An instruct model's turn end is often only in generation_config.json (Llama 3's
        # <|eot_id|>, Qwen2.5's <|endoftext|>): generate() and vLLM stop on its list too.
        gen = path.with_name("generation_config.json")
        for eid in _eos_ids(_json_object(gen).get("eos_token_id") if gen.is_file() else None):
            if eid not in cfg.eos_token_id:
                cfg.eos_token_id.append(eid)
        return cfg

    @classmethod
    def _parse(cls, arch: str, raw: dict[str, Any]) -> ModelConfig:
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{arch}: hidden_act {act!r} unsupported (only 'silu')")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(f"{arch}: {heads} heads not divisible by {kv_heads} kv heads")
        if head_dim % 2:
            raise ModelLoadError(f"{arch}: head_dim {head_dim} must be even for RoPE")
        max_pos = int(raw.get("max_position_embeddings", 2048))

        # transformers 5 nests rope settings in `rope_parameters`; older files use
        # top-level `rope_theta` + `rope_scaling`.
        rope_params = raw.get("rope_parameters") or {}
        scaling_raw = raw.get("rope_scaling") or {}
        if "rope_layer_types" in rope_params or any(
            isinstance(v, dict) for v in rope_params.values()
        ):
            raise ModelLoadError(f"{arch}: per-layer rope_parameters are unsupported")
        rope_theta = float(rope_params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
        merged = {**scaling_raw, **rope_params}
        rope_type = merged.get("rope_type") or merged.get("type") or "default"
        if float(merged.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ModelLoadError(f"{arch}: partial_rotary_factor != 1 is unsupported")
        rope_scaling: RopeScaling | None
        if rope_type == "default":
            rope_scaling = None
        elif rope_type == "llama3":
            rope_scaling = RopeScaling(
                rope_type="llama3",
                factor=float(merged["factor"]),
                low_freq_factor=float(merged["low_freq_factor"]),
                high_freq_factor=float(merged["high_freq_factor"]),
                original_max_position_embeddings=int(
                    merged.get("original_max_position_embeddings", max_pos)
                ),
            )
        else:
            raise ModelLoadError(
                f"{arch}: rope type {rope_type!r} unsupported (supported: default, llama3)"
            )

        if arch == "Qwen2ForCausalLM":
            attention_bias, o_bias, mlp_bias = True, False, False
            sliding = _qwen2_sliding_window(raw)
        elif arch == "MistralForCausalLM":
            attention_bias = o_bias = mlp_bias = False
            sliding = raw.get("sliding_window")
        else:
            attention_bias = o_bias = bool(raw.get("attention_bias", False))
            mlp_bias = bool(raw.get("mlp_bias", False))
            sliding = None

        eos_ids = _eos_ids(raw.get("eos_token_id"))
        bos = raw.get("bos_token_id")
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        dtype = dtype_of(str(dtype_name))
        if dtype is None:
            raise ModelLoadError(f"{arch}: unsupported dtype {dtype_name!r}")

        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=int(sliding) if sliding else None,
            max_position_embeddings=max_pos,
            eos_token_id=eos_ids,
            bos_token_id=None if bos is None else int(bos),
            torch_dtype=dtype,
        )

    def rope_inv_freq(self) -> torch.Tensor:
        """Float32 inverse frequencies [head_dim // 2], bit-identical to transformers' init."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        s = self.rope_scaling
        if s is None:
            return inv
        low_wl = s.original_max_position_embeddings / s.low_freq_factor
        high_wl = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)


@dataclass(slots=True, frozen=True)
class ModelPart:
    """The slice of the network one process holds: a contiguous layer range, plus the input
    embedding (first pipeline stage) and the final norm + LM head (last stage).

    Engine layer ``i`` of a part is checkpoint layer ``first_layer + i``; a single-process model
    is :meth:`whole`.
    """

    first_layer: int
    num_layers: int
    embed: bool
    head: bool

    @classmethod
    def whole(cls, cfg: ModelConfig) -> ModelPart:
        return cls(0, cfg.num_hidden_layers, embed=True, head=True)

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    def validate(self, cfg: ModelConfig) -> None:
        if self.first_layer < 0 or self.num_layers < 0:
            raise ModelLoadError(f"bad model part {self}")
        if self.first_layer + self.num_layers > cfg.num_hidden_layers:
            raise ModelLoadError(
                f"model part layers {self.first_layer}..{self.first_layer + self.num_layers - 1} "
                f"exceed the checkpoint's {cfg.num_hidden_layers} layers"
            )


def _qwen2_sliding_window(raw: dict[str, Any]) -> int | None:
    # Qwen2 only windows when use_sliding_window is set, and then only on some layers; the
    # engine applies one window to every layer, so a mixed layout is rejected rather than
    # silently mis-attended.
    if not raw.get("use_sliding_window") or not raw.get("sliding_window"):
        return None
    n = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if i >= int(raw.get("max_window_layers", 28)) else "full_attention"
        for i in range(n)
    ]
    if all(t == "full_attention" for t in layer_types):
        return None
    if all(t == "sliding_attention" for t in layer_types):
        return int(raw["sliding_window"])
    raise ModelLoadError("Qwen2ForCausalLM: mixed sliding/full attention layers are unsupported")


def _eos_ids(eos: Any) -> list[int]:
    """config.json's or generation_config.json's eos_token_id (an id, a list of them, or none)."""
    if eos is None:
        return []
    try:
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    except (TypeError, ValueError):
        raise ModelLoadError(f"eos_token_id {eos!r} is not a token id or a list of them") from None


def _json_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return raw
