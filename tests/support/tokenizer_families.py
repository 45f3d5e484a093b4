"""Model folders of each tokenizer family a Llama-family checkpoint can carry, trained
offline (a helper module, not a test module).

- byte_bpe: byte-level BPE, as Llama 3, Qwen2 and the embedded presets ship;
- metaspace_bpe: sentencepiece-style BPE with a Metaspace pre-tokenizer and decoder, as
  most sentencepiece-converted tokenizer.json files (Llama 2, Mistral v0.1) have it;
- unigram: a sentencepiece Unigram model, Metaspace too.

Each has Llama's special tokens (<unk> 0, <s> 1, </s> 2), a post-processor that puts
<s> before a text, `add_bos_token: true` and a Llama-2-style chat template that starts
with `{{ bos_token }}`. The corpus is the standard library's text (as the presets'),
plus lines with multi-byte characters so those are whole tokens of the vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, processors
from tokenizers.implementations import SentencePieceBPETokenizer, SentencePieceUnigramTokenizer

from scheduler.model.tokenizer_build import BOS_ID, SPECIAL_TOKENS, stdlib_corpus, train_tokenizer

FAMILIES = ("byte_bpe", "metaspace_bpe", "unigram")
VOCAB = 1200
MULTIBYTE = "héllo wörld naïve café, 日本語のテキスト, emoji 🎉🚀, Ωμέγα — “quotes” ½ €"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def _corpus() -> list[str]:
    return stdlib_corpus(200_000) + [MULTIBYTE] * 40


def train(kind: str) -> Tokenizer:
    if kind == "byte_bpe":
        return train_tokenizer(VOCAB, _corpus())
    impl: SentencePieceBPETokenizer | SentencePieceUnigramTokenizer
    if kind == "metaspace_bpe":
        impl = SentencePieceBPETokenizer(unk_token=SPECIAL_TOKENS[0])
        impl.train_from_iterator(_corpus(), vocab_size=VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                 show_progress=False)
    elif kind == "unigram":
        impl = SentencePieceUnigramTokenizer()
        impl.train_from_iterator(_corpus(), vocab_size=VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                 unk_token=SPECIAL_TOKENS[0], show_progress=False)
    else:
        raise ValueError(f"unknown tokenizer family {kind!r}")
    tok: Tokenizer = impl._tokenizer
    assert tok.token_to_id("<s>") == BOS_ID
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    return tok


def build_family(kind: str, out_dir: Path) -> Path:
    """A folder with tokenizer.json and tokenizer_config.json of that family."""
    out_dir.mkdir(parents=True, exist_ok=True)
    train(kind).save(str(out_dir / "tokenizer.json"))
    # transformers 5 rebuilds a LlamaTokenizerFast from its vocabulary as BPE, so a Unigram
    # folder names the generic class (as real Unigram folders do)
    cls = "PreTrainedTokenizerFast" if kind == "unigram" else "LlamaTokenizerFast"
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": cls, "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 4096,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }))
    return out_dir
