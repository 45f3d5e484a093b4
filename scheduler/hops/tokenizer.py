"""Text <-> token ids for a model folder, and incremental detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """tokenizer.json through the fast `tokenizers` library when present (it is
    what every recent Llama-family folder ships); transformers' AutoTokenizer
    otherwise, e.g. for sentencepiece-only folders."""

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        self._tok: Any
        if (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as FastTokenizer

            self._tok = FastTokenizer.from_file(str(d / "tokenizer.json"))
            self._fast = True
        else:
            try:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
            except Exception as e:  # noqa: BLE001 - any failure means "no usable tokenizer"
                raise TokenizerError(f"no usable tokenizer in {d}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
            self._fast = False

    def encode(self, text: str) -> list[int]:
        if self._fast:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size()) if self._fast else len(self._tok)


class IncrementalDetokenizer:
    """Emits text as tokens arrive without re-decoding the whole output each time.

    Byte-level BPE can split one UTF-8 character across tokens; text is held
    back while the tail decodes to U+FFFD, and a small window of previous
    tokens is re-decoded so merges at the seam (e.g. leading spaces) are right.
    """

    __slots__ = ("_tok", "_ids", "_prefix", "_read")

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0  # start of the re-decode window
        self._read = 0  # tokens already turned into emitted text

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(prefix_text) :]

    def flush(self) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full[len(prefix_text) :]
