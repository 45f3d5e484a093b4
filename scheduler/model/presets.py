"""Embedded default models ("presets") that are generated locally, never downloaded.

mstrace studies how an inference engine schedules work, not what a model says,
so it needs a model whose *shape* is realistic (Llama architecture, GQA, a
byte-level BPE tokenizer) but does not need trained weights. Generating one
keeps every run offline, removes the hub as a dependency of tests and CI, and
makes runs reproducible: a preset name plus the generator version fully
determine the tokenizer and the weights, so two machines tracing ``default``
trace the same model.

A preset is written in plain Hugging Face layout (``config.json``,
``model.safetensors``, tokenizer files), so the reference ``transformers``
implementation can load the very same folder and check the engine against it.

Weights are normal draws from a ``torch.Generator``
seeded by the spec; the tokenizer is trained on text from the Python standard
library (see :mod:`scheduler.model.tokenizer_build`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file

from scheduler.hops.tokenizer import PRESET_MANIFEST
from scheduler.model import tokenizer_build

# Bump when anything about how a preset folder is produced changes (weight
# draw order, file contents, config fields), so stale caches are not reused.
GENERATOR_VERSION = 1

CACHE_ENV_VAR = "MSTRACE_CACHE_DIR"
# Written last in a build: what built the folder, and its files' hashes.
MANIFEST_NAME = PRESET_MANIFEST
REQUIRED_FILES: tuple[str, ...] = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    MANIFEST_NAME,
)
# A temp build folder older than this is from a killed build, not a live one.
STALE_TMP_SECONDS = 3600.0


@dataclass(slots=True, frozen=True)
class PresetSpec:
    """Architecture numbers of one preset (Llama, float32).

    With ``tie_word_embeddings`` the special tokens' output rows are not
    zeroed (they double as input embeddings), so greedy decoding may emit
    ``</s>``; the built-in presets are all untied.
    """

    description: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    initializer_range: float
    # lm_head gets its own, larger std; see the note above PRESETS.
    lm_head_initializer_range: float
    seed: int

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size < tokenizer_build.MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be at least {tokenizer_build.MIN_VOCAB_SIZE}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in _parameter_plan(self))

    def hf_config(self, tok: tokenizer_build.TokenizerInfo) -> dict[str, object]:
        """The ``config.json`` contents for this spec and its tokenizer."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            # Both spellings: transformers < 5 reads rope_theta, >= 5 prefers
            # rope_parameters; they agree, so either reader gets the same model.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": None,
            "torch_dtype": "float32",
            "use_cache": True,
        }


# How the init scales were chosen (measured with transformers, greedy decoding
# of 4-8k steps per preset):
# - initializer_range (embeddings and all layer weights) is 0.05 rather than
#   Llama's 0.02: at 0.02 `default` falls into a fixed point and greedy
#   decoding repeats one token forever, which would hide KV-cache bugs (a
#   repeated token is consistent with almost any cache). At 0.05 outputs are
#   varied and the next token depends on more than the last 8 tokens.
# - lm_head_initializer_range is larger: after the final RMSNorm the logits'
#   spread is lm_head std * sqrt(hidden_size). With everything at 0.02, 1.2%
#   of `default`'s greedy steps had a top-1/top-2 margin under 1e-3; with the
#   values below the logits' std is 8 (tiny, small) or 11 (default) and
#   about 0.06% of steps have a margin under 1e-3, 0.4-0.5% under 1e-2.
#   Scaling lm_head further would shrink those fractions but not the real
#   risk: float noise in the logits scales with lm_head too (it is ~2e-6 of
#   the logits' std here), so the chance that noise flips a greedy token,
#   about 1 in 10^4-10^5 steps for `default`, is set by the layers, not by
#   this scale. Comparisons against a reference should tolerate it.
#   Only lm_head is scaled: a large *embedding* instead turns the model into
#   a bigram table whose output ignores the context.
PRESETS: dict[str, PresetSpec] = {
    "tiny": PresetSpec(
        description="0.15M params; for unit tests, builds in under a second",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.05,
        lm_head_initializer_range=1.0,
        seed=1,
    ),
    "small": PresetSpec(
        description="5.2M params; quick end-to-end runs where compute still shows",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.05,
        lm_head_initializer_range=0.5,
        seed=2,
    ),
    "default": PresetSpec(
        description="34M params; model compute dominates an engine step on a 2-core CPU",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.05,
        lm_head_initializer_range=0.5,
        seed=3,
    ),
}


def _known() -> str:
    return ", ".join(PRESETS)


def _parameter_plan(spec: PresetSpec) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Yield (HF name, shape, init kind) in the fixed order weights are drawn.

    The order is part of the format: changing it changes every weight, so it
    needs a GENERATOR_VERSION bump.
    """
    h, i = spec.hidden_size, spec.intermediate_size
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.num_key_value_heads * spec.head_dim
    yield "model.embed_tokens.weight", (spec.vocab_size, h), "normal"
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,), "ones"
        yield p + "self_attn.q_proj.weight", (q_out, h), "normal"
        yield p + "self_attn.k_proj.weight", (kv_out, h), "normal"
        yield p + "self_attn.v_proj.weight", (kv_out, h), "normal"
        yield p + "self_attn.o_proj.weight", (h, q_out), "normal"
        yield p + "post_attention_layernorm.weight", (h,), "ones"
        yield p + "mlp.gate_proj.weight", (i, h), "normal"
        yield p + "mlp.up_proj.weight", (i, h), "normal"
        yield p + "mlp.down_proj.weight", (h, i), "normal"
    yield "model.norm.weight", (h,), "ones"
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", (spec.vocab_size, h), "lm_head"


_SPECIAL_IDS = (tokenizer_build.UNK_ID, tokenizer_build.BOS_ID, tokenizer_build.EOS_ID)


def generate_weights(spec: PresetSpec) -> dict[str, torch.Tensor]:
    """Draw the preset's weights; same spec, same torch version -> same bits."""
    gen = torch.Generator(device="cpu").manual_seed(spec.seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape, kind in _parameter_plan(spec):
        if kind == "ones":
            weights[name] = torch.ones(shape, dtype=torch.float32)
            continue
        std = spec.lm_head_initializer_range if kind == "lm_head" else spec.initializer_range
        t = torch.empty(shape, dtype=torch.float32)
        t.normal_(mean=0.0, std=std, generator=gen)
        if kind == "lm_head":
            # Zero rows make the special tokens' logits exactly 0, below the
            # maximum of thousands of logits with std ~10, so greedy decoding
            # never emits <unk>/<s>/</s>: a request then runs to its
            # max_new_tokens and the workload, not chance, sets output lengths.
            # (Not done when tied: it would also zero the <s> input embedding.)
            t[list(_SPECIAL_IDS)] = 0.0
        weights[name] = t
    return weights


@functools.cache
def _environment_fingerprint(vocab_size: int) -> dict[str, str]:
    # Things outside the spec that change the built bytes: the stdlib text the
    # tokenizer learns from, the BPE trainer, and torch's normal() sampler.
    torch_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return {
        "corpus": tokenizer_build.corpus_fingerprint(vocab_size),
        "tokenizer_recipe": str(tokenizer_build.TOKENIZER_RECIPE_VERSION),
        "tokenizers": tokenizers.__version__,
        "torch": torch_minor,
    }


def preset_key(name: str) -> str:
    """Cache folder name: ``<name>-<hash of spec, generator and environment>``."""
    spec = get_spec(name)
    payload = {
        "spec": dataclasses.asdict(spec),
        "generator_version": GENERATOR_VERSION,
        "environment": _environment_fingerprint(spec.vocab_size),
    }
    blob = json.dumps(payload, sort_keys=True).encode("utf-8")
    return f"{name}-{hashlib.sha256(blob).hexdigest()[:12]}"


def get_spec(name: str) -> PresetSpec:
    """The spec of preset ``name``; ``ValueError`` naming the known ones if unknown."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r} (known presets: {_known()})") from None


def default_cache_dir() -> Path:
    """``$MSTRACE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mstrace/models``, else ``~/.cache/...``."""
    explicit = os.environ.get(CACHE_ENV_VAR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mstrace" / "models"


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_preset(spec: PresetSpec, out_dir: Path, name: str = "custom") -> None:
    """Write a complete HF model folder for ``spec`` into ``out_dir`` (no caching)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_build.build_tokenizer(out_dir, spec.vocab_size, spec.max_position_embeddings)
    _write_json(out_dir / "config.json", spec.hf_config(tok))
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            # Greedy by default: traces of the same run should be comparable.
            "do_sample": False,
        },
    )
    # metadata format=pt: transformers refuses safetensors files without it.
    save_file(generate_weights(spec), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    files = sorted(p.name for p in out_dir.iterdir() if p.is_file())
    _write_json(
        out_dir / MANIFEST_NAME,
        {
            "name": name,
            "spec": dataclasses.asdict(spec),
            "generator_version": GENERATOR_VERSION,
            "environment": _environment_fingerprint(spec.vocab_size),
            "num_parameters": spec.num_parameters(),
            "sha256": {f: _sha256(out_dir / f) for f in files},
        },
    )


def _is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in REQUIRED_FILES)


def _remove_stale_tmp(parent: Path, key: str) -> None:
    # Killed builds leave their temp folder behind; sweep old ones so the cache
    # does not grow, but leave young ones alone: they may be live builds.
    now = time.time()
    for p in parent.glob(f".{key}.tmp-*"):
        try:
            if now - p.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


BUILD_LOCK_TIMEOUT_S = 1800.0  # another process's build of the same preset: the default preset takes minutes


def ensure_preset(name: str, cache_dir: Path | None = None) -> Path:
    """Return the folder of preset ``name``, building it on first use.

    The build happens in a temp folder next to the final one and is renamed
    into place in one step, so a reader never sees a half-written preset and a
    killed build leaves nothing under the final name. One build at a time (a
    lock file beside it, `.KEY.lock`): a second process waits and takes the
    first's folder.
    """
    spec = get_spec(name)
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = preset_key(name)
    final = parent / key
    if _is_complete(final):
        return final
    parent.mkdir(parents=True, exist_ok=True)
    from tracing.store_lock import exclusive

    # One build at a time: a second process waits, then finds the first's folder complete.
    # (Without it, a process that found the folder incomplete removed it under another that
    # had just renamed its build in and was about to load it.)
    with exclusive(parent / f".{key}.lock", BUILD_LOCK_TIMEOUT_S):
        if _is_complete(final):
            return final
        if final.exists():  # files deleted by hand; no build runs now (the lock), so none is lost
            shutil.rmtree(final, ignore_errors=True)
        _build_into(spec, name, parent, key, final)
    return final


def _build_into(spec: PresetSpec, name: str, parent: Path, key: str, final: Path) -> None:
    _remove_stale_tmp(parent, key)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=parent))
    try:
        build_preset(spec, tmp, name=name)
        # mkdtemp makes the folder owner-only; a model folder is not secret,
        # and a cache shared between users or containers must be readable.
        os.chmod(tmp, 0o755)
        try:
            # rename(2) of a directory is atomic and refuses to replace a non-empty one:
            # a build by a process that took no lock (an older mstrace) got there first
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(spec: str, cache_dir: Path | None = None) -> Path:
    """Map a ``--model`` argument to a folder: a preset name or an HF folder path."""
    if spec in PRESETS:
        return ensure_preset(spec, cache_dir)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {spec} (known presets: {_known()})")
    return path
