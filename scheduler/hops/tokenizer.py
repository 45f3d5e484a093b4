"""Text <-> token ids for a model folder, and incremental detokenization.

Prompts are encoded as the folder's own tokenizer does in transformers: with the
special tokens its post-processor adds (Llama's BOS) unless the caller says not to
(a rendered chat template already carries them). Output text is decoded in the
prompt's context, so a sentencepiece (Metaspace) tokenizer's leading space on the
first output token survives, exactly as `decode(prompt + output)` minus
`decode(prompt)` has it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

# The prompt context a detokenizer is seeded with: at least this many tokens, at least
# two of them not special (a suffix of only special tokens, which decode skips, would
# make the first output token look like the start of the text), never a suffix whose
# decode starts inside a UTF-8 character; at most PROMPT_CONTEXT_MAX tokens.
PROMPT_CONTEXT_MIN = 4
PROMPT_CONTEXT_MAX = 32

# Written last into a folder mstrace built (scheduler/model/presets.py). Such a folder's
# tokenizer.json is written for PreTrainedTokenizerFast, which AutoTokenizer loads as it is
# (tests/test_tokenizer.py compares the two), so it is read directly: importing transformers
# is about 2 s of every run's start-up.
PRESET_MANIFEST = "mstrace_preset.json"


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """The folder's tokenizer as transformers' AutoTokenizer loads it, since that is
    what vLLM, lm-evaluation-harness and the folder's authors encode with: transformers
    rebuilds some classes (LlamaTokenizerFast among them) from the vocabulary with its
    own pipeline, so tokenizer.json read alone can give other ids. Encoding and decoding
    then go through its Rust tokenizer where it has one. A folder transformers cannot
    load but with a tokenizer.json is read from that file as it is."""

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        self._tok: Any
        if (d / PRESET_MANIFEST).is_file() and (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as FastTokenizer

            self._tok, self._fast = FastTokenizer.from_file(str(d / "tokenizer.json")), True
            self._special = self._special_of_fast()
            return
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any failure means "not through transformers"
            if not (d / "tokenizer.json").is_file():
                raise TokenizerError(f"no usable tokenizer in {d}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
            from tokenizers import Tokenizer as FastTokenizer

            hf = None
            self._tok = FastTokenizer.from_file(str(d / "tokenizer.json"))
        else:
            self._tok = getattr(hf, "backend_tokenizer", None) or hf
        self._fast = hf is None or self._tok is not hf
        if self._fast:
            self._special = self._special_of_fast()
        else:
            self._special = frozenset(int(i) for i in self._tok.all_special_ids)

    def _special_of_fast(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, what the folder's tokenizer adds
        around it (transformers' default for a plain `tokenizer(text)`)."""
        if self._fast:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def token_text(self, token_id: int) -> tuple[str, bool]:
        """One token's own text, special tokens written out (what logprobs name a token by,
        as vLLM does: the decode of that token alone), and whether it is special (then the
        decoded output text, which skips special tokens, does not hold it)."""
        return str(self._tok.decode([token_id], skip_special_tokens=False)), token_id in self._special

    def special_prefix(self) -> str:
        """The text of the special tokens put before every encoded text (Llama: "<s>";
        "" for a tokenizer that adds none), for templates that must write them out."""
        ids = self.encode("")
        return str(self._tok.decode(ids, skip_special_tokens=False)) if ids else ""

    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size()) if self._fast else len(self._tok)

    @functools.cached_property
    def replacement_ids(self) -> list[int]:
        """The tokens of a literal U+FFFD: a prompt ending in them ends on a whole character."""
        return self.encode("\ufffd", add_special_tokens=False)

    def prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The suffix of a prompt that output text is decoded after (PROMPT_CONTEXT_MIN)."""
        n, plain = 0, 0
        while n < len(prompt_ids) and n < PROMPT_CONTEXT_MAX and (n < PROMPT_CONTEXT_MIN or plain < 2):
            n += 1
            plain += prompt_ids[-n] not in self._special
        while n < min(len(prompt_ids), PROMPT_CONTEXT_MAX) and self.decode(prompt_ids[-n:]).startswith("\ufffd"):
            n += 1
        return prompt_ids[len(prompt_ids) - n:]

    def detokenizer(self, prompt_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, self.prompt_context(prompt_ids))


class IncrementalDetokenizer:
    """Emits text as tokens arrive without re-decoding the whole output each time.

    A token can end inside a UTF-8 character (byte-level BPE, byte fallback); its text
    is held back until the character completes. Each push decodes only a window (the
    tokens before the last emitted text, then the new ones) twice, and emits the
    difference: merges at the seam (leading spaces, a Metaspace decoder's first-token
    rule) come out as in the full decode. The window starts as the prompt's context.

    Not tokenizers' DecodeStream, though it does the same in Rust: seeded with a prompt
    whose decode ends inside a character, its first chunk is the whole prompt's text
    (tokenizers 0.23), and measured per token it is no faster (2.7 against 2.5 us on the
    tiny preset's tokenizer; the decodes dominate either way).
    """

    __slots__ = ("_tok", "_ids", "_prefix", "_read")

    def __init__(self, tok: Tokenizer, context: list[int] | None = None) -> None:
        self._tok = tok
        # _ids[_prefix:_read] is the window's context; _ids[_read:] what is not yet emitted
        self._ids: list[int] = list(context or ())
        self._prefix = 0
        self._read = len(self._ids)
        # A prompt that ends inside a character (a continuation of an output cut there): its
        # last tokens are emitted with the output that completes the character. Counted as
        # emitted, the completed character's text fell short of the prefix's U+FFFD and was
        # lost, and every later push sliced the window at that wrong length.
        lit = tok.replacement_ids
        while self._read and tok.decode(self._ids[: self._read]).endswith("\ufffd"):
            if lit and self._ids[max(0, self._read - len(lit)): self._read] == lit:
                break  # a literal U+FFFD in the prompt: a whole character
            self._read -= 1

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > 256:  # only the window is decoded again: the list must not grow with the output
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return full[len(prefix_text) :]

    def flush(self) -> str:
        """The held-back text at the end (an incomplete character decodes to U+FFFD, as
        in the full decode)."""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full[len(prefix_text) :] if len(full) > len(prefix_text) else ""
