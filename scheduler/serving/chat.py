"""Chat messages -> one prompt: the model folder's chat template when it has one,
else a documented plain template (docs/serve.md, "Chat").

The rendered text carries the special tokens itself (a Llama template begins with
`{{ bos_token }}`), so it is encoded without adding them again (vLLM's chat default)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scheduler.serving.protocol import BadRequest, ChatMessage

# The plain template for folders without one (the embedded models): the special tokens the
# tokenizer puts before a text (its BOS), a line per message, "role: text", then
# "assistant:" for the model to continue.
PLAIN = "plain"


class ChatTemplate:
    def __init__(self, model_dir: Path, special_prefix: str = "") -> None:
        self.kind = PLAIN
        self._prefix = special_prefix
        self._tok: Any = None
        if _has_template(model_dir):
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            self.kind = "the model's"

    def render(self, messages: list[ChatMessage]) -> str:
        if self._tok is None:
            return self._prefix + "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant:"
        turns = [{"role": m.role, "content": m.text()} for m in messages]  # a part refused: its own error
        try:
            out = self._tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages (roles, order)
            raise BadRequest(f"the model's chat template refused these messages: {str(e).splitlines()[0]}",
                             param="messages") from None
        return str(out)


def _has_template(d: Path) -> bool:
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(isinstance(cfg, dict) and cfg.get("chat_template"))
