"""The OpenAI-compatible request bodies, their mapping to the engine's sampling
parameters, and OpenAI's error object.

Fields are strictly typed (a string where a number belongs is a 400, not a
coercion); unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.core.request import SamplingParams

# The engine's finish reasons as OpenAI's finish_reason (and vLLM's finished_reason label):
# a request the engine refused is "error", one aborted (disconnect, shutdown) "abort".
FINISH_REASON = {"eos": "stop", "length": "length", "aborted": "abort", "rejected": "error"}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    ignore_eos: bool = False  # an extension (vLLM's): generate max_tokens whatever the model says
    # vLLM's: a text prompt gets the tokenizer's special tokens (BOS); a chat template has its own
    add_special_tokens: bool = True

    def stop_strings(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [x for x in s if x]

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def params(self, max_tokens: int | None) -> SamplingParams:
        """None: as many as the context and the KV pool leave after the prompt (OpenAI's chat default)."""
        return SamplingParams(max_new_tokens=max_tokens or 1, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed, ignore_eos=self.ignore_eos, fill_context=max_tokens is None)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, gt=0)  # OpenAI's default for completions

    def one_prompt(self) -> str | list[int]:
        """The request's single prompt (a list of one prompt is that prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        # the strict union has made a list all ints, all strings or all lists: its first says which
        if p and isinstance(p[0], int):
            return list(p)  # type: ignore[arg-type]
        if len(p) == 1:
            return p[0]  # type: ignore[return-value]
        raise BadRequest("prompt must be one string or one list of token ids (batches are not served)",
                         param="prompt")


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    add_special_tokens: bool = False

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class BadRequest(Exception):
    """A request the server refuses, as OpenAI's error object (`error_body`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def created() -> int:
    return int(time.time())
