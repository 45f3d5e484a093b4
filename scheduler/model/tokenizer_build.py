"""Train the byte-level BPE tokenizer that the embedded preset models ship with.

The corpus is text that every Python install carries: the prose of the language
reference (``pydoc_data/topics.py``) followed by the top-level modules of the
standard library. Nothing is downloaded, and the same Python install, vocab
size and ``tokenizers`` version always give byte-identical ``tokenizer.json``.

Token ids 0, 1 and 2 are ``<unk>``, ``<s>`` and ``</s>``, as in Llama, so the
config written next to the weights can name them without looking them up.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS: tuple[str, ...] = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# Smallest vocab that still holds the specials and all 256 byte symbols; below
# it BPE has no room for the byte alphabet and round-tripping breaks.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

# The corpus grows with the vocab (more merges need more text to rank), capped
# so that even the largest preset trains in about a second on 2 cores; small
# vocabs get less text, which keeps the test presets quick to build.
CORPUS_MAX_CHARS = 3_000_000
CORPUS_MIN_CHARS = 400_000
CORPUS_CHARS_PER_TOKEN = 300
# A third of the budget is English prose, the rest code, spread evenly over
# the modules so the corpus covers the whole alphabet of modules rather than
# stopping at the first few big ones (``_pydecimal``, ``argparse``, ...).
PROSE_SHARE = 1 / 3
MODULE_MIN_CHARS = 2_000

# Bumped whenever the corpus selection or the trainer settings change, so that
# cached presets built with an older recipe get a new cache key.
TOKENIZER_RECIPE_VERSION = 1


@dataclass(slots=True, frozen=True)
class TokenizerInfo:
    """What the model config needs to know about a saved tokenizer."""

    vocab_size: int
    unk_token_id: int
    bos_token_id: int
    eos_token_id: int


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_chars(vocab_size: int) -> int:
    """Corpus size used to train a vocab of ``vocab_size``."""
    return max(CORPUS_MIN_CHARS, min(CORPUS_MAX_CHARS, CORPUS_CHARS_PER_TOKEN * vocab_size))


def stdlib_corpus(max_chars: int = CORPUS_MAX_CHARS) -> list[str]:
    """Return the training texts, in a fixed order, totalling at most ``max_chars``."""
    root = _stdlib_dir()
    texts: list[str] = []
    # Prose first: the reference manual text teaches the merges for English
    # words, the modules after it teach the ones for code.
    topics = root / "pydoc_data" / "topics.py"
    if topics.is_file():
        texts.append(
            topics.read_text(encoding="utf-8", errors="replace")[: int(max_chars * PROSE_SHARE)]
        )
    # Top-level modules only: a recursive walk would pull in test/ and
    # site-packages (slow, and site-packages differs between environments).
    modules = sorted(root.glob("*.py"))
    if not modules:
        raise RuntimeError(f"no standard-library sources found under {root}")
    total = sum(map(len, texts))
    per_module = max(MODULE_MIN_CHARS, (max_chars - total) // len(modules))
    for path in modules:
        text = path.read_text(encoding="utf-8", errors="replace")[:per_module]
        text = text[: max_chars - total]
        if text:
            texts.append(text)
            total += len(text)
        if total >= max_chars:
            break
    return texts


def corpus_fingerprint(vocab_size: int) -> str:
    """Short hash of the corpus for ``vocab_size``, so a cache key changes when the stdlib does."""
    h = hashlib.sha256()
    for text in stdlib_corpus(corpus_chars(vocab_size)):
        h.update(text.encode("utf-8", errors="replace"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def train_tokenizer(vocab_size: int, texts: list[str] | None = None) -> Tokenizer:
    """Train a byte-level BPE tokenizer of exactly ``vocab_size`` entries."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    # add_prefix_space=False keeps decode(encode(s)) == s exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # Seed the whole byte alphabet so any text, including bytes the corpus
        # never contains, encodes without <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is None:
        texts = stdlib_corpus(corpus_chars(vocab_size))
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        # A corpus too small for the requested merges would silently give a
        # smaller vocab and an embedding matrix that disagrees with it.
        raise RuntimeError(f"trained vocab has {tok.get_vocab_size()} entries, wanted {vocab_size}")
    for token, want in zip(SPECIAL_TOKENS, (UNK_ID, BOS_ID, EOS_ID), strict=True):
        got = tok.token_to_id(token)
        if got != want:
            raise RuntimeError(f"special token {token} has id {got}, expected {want}")
    # Prepend <s> like Llama does; the engine and HF then agree on prompt ids.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tok


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> TokenizerInfo:
    """Write ``tokenizer.json`` plus the HF side files that ``AutoTokenizer`` reads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # pretty=False: smaller, and the bytes do not depend on the JSON printer's
    # indentation rules.
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=False), encoding="utf-8")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN}
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            # Named explicitly so AutoTokenizer loads tokenizer.json as it is
            # instead of guessing a class from config.json's model_type
            # ("llama" maps to a SentencePiece-style tokenizer in some
            # transformers versions, which would not round-trip byte-level BPE).
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            **special,
        },
    )
    _write_json(out_dir / "special_tokens_map.json", special)
    return TokenizerInfo(
        vocab_size=tok.get_vocab_size(),
        unk_token_id=UNK_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def build_tokenizer(
    out_dir: Path, vocab_size: int, model_max_length: int, texts: list[str] | None = None
) -> TokenizerInfo:
    """Train on the stdlib corpus and save into ``out_dir``."""
    return save_tokenizer(train_tokenizer(vocab_size, texts), out_dir, model_max_length)
