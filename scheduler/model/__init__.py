"""The engine's own model stack: config, loader, paged KV cache, batch layout, forward, sampling."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError, RopeScaling
from .forward_batch import ForwardBatch, PrefillAttn, SeqChunk, build_forward_batch
from .kv_cache import PagedKVCache
from .loader import ShardFn, WeightTarget, load_model, weight_targets
from .sampling import sample
from .transformer import CausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "ForwardBatch",
    "ModelConfig",
    "ModelLoadError",
    "PagedKVCache",
    "PrefillAttn",
    "RopeScaling",
    "SeqChunk",
    "ShardFn",
    "WeightTarget",
    "build_forward_batch",
    "load_model",
    "sample",
    "weight_targets",
]
