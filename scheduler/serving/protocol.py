"""The OpenAI-compatible request bodies, their mapping to the engine's sampling
parameters, and OpenAI's error object.

Fields are strictly typed (a string where a number belongs is a 400, not a
coercion); unknown fields are ignored, as OpenAI-compatible servers do. A field the API
(or vLLM's extensions) defines but this server does not implement is never ignored: a
value that would change the output is a 400 naming it (`unsupported`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.core.request import MAX_LOGPROBS, SamplingParams

# The engine's finish reasons as OpenAI's finish_reason (and vLLM's finished_reason label):
# a request the engine refused is "error", one aborted (disconnect, shutdown) "abort".
# Samples per prompt: each is an engine request, sharing the prompt's KV blocks
MAX_N = 16

# The engine finishes a request whose stop string matched as an abort with this detail: the
# sender saw the match, the engine did not (the metrics count it a "stop", as the client sees it)
STOP_MATCHED = "stop string matched"
FINISH_REASON = {"eos": "stop", "stop_token": "stop", "length": "length", "aborted": "abort", "rejected": "error"}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; refused (`unsupported`)


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    ignore_eos: bool = False  # an extension (vLLM's): generate max_tokens whatever the model says
    # Logit processing before the draw (scheduler/model/penalties.py; vLLM's semantics)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's) -> bias in [-100, 100]
    stop_token_ids: list[int] | None = None  # vLLM's: each ends the output, its text left out
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's: EOS and stop_token_ids banned until then
    # Known fields not implemented: their neutral value is accepted, any other refused.
    best_of: int | None = None
    top_k: int | None = None  # vLLM's; -1 and 0 (vLLM's and HF's "off") are the neutral values
    min_p: float | None = None  # vLLM's
    response_format: dict[str, Any] | None = None
    guided_json: Any = None  # vLLM's guided decoding (and its successor, structured_outputs)
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # vLLM's: a text prompt gets the tokenizer's special tokens (BOS); a chat template has its own
    add_special_tokens: bool = True

    def stop_strings(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [x for x in s if x]

    def unsupported(self) -> None:
        """BadRequest for the first field asked for that this server does not implement."""
        checks: list[tuple[str, bool]] = [
            ("best_of", self.best_of not in (None, self.n)),
            ("top_k", self.top_k not in (None, -1, 0)),
            ("min_p", self.min_p not in (None, 0.0)),
            ("response_format", self.response_format is not None and self.response_format.get("type") != "text"),
            *((g, getattr(self, g) is not None) for g in ("guided_json", "guided_regex", "guided_choice",
                                                          "guided_grammar", "structured_outputs")),
            *self._unsupported(),
        ]
        for name, asked in checks:
            if asked:
                raise BadRequest(f"{name}: not supported by this server (docs/serve.md, \"Request fields\")",
                                 param=name, code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options: only allowed with stream: true", param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise BadRequest("stream_options.continuous_usage_stats: not supported by this server",
                             param="stream_options.continuous_usage_stats", code="unsupported_parameter")

    def _unsupported(self) -> list[tuple[str, bool]]:
        return []

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def params(self, max_tokens: int | None, logprobs: int | None = None,
               prompt_logprobs: int | None = None) -> SamplingParams:
        """None: as many as the context and the KV pool leave after the prompt (OpenAI's chat
        default). 0 (completions with echo): one is generated and not returned (vLLM's way)."""
        if self.min_tokens and max_tokens is not None and self.min_tokens > max(max_tokens, 1):
            raise BadRequest(f"min_tokens: {self.min_tokens} is more than max_tokens {max_tokens}", param="min_tokens")
        return SamplingParams(max_new_tokens=max_tokens or 1, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed, ignore_eos=self.ignore_eos, fill_context=max_tokens is None,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=self.repetition_penalty or 1.0, logit_bias=self._bias(),
                              min_tokens=self.min_tokens or 0, stop_token_ids=tuple(self.stop_token_ids or ()))

    def _bias(self) -> tuple[tuple[int, float], ...]:
        out = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise BadRequest(f"logit_bias: the key {key!r} is not a token id", param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise BadRequest(f"logit_bias: the bias of {key} is {bias}, not in [-100, 100]", param="logit_bias")
            out.append((int(key), float(bias)))
        return tuple(out)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default; 0 only with echo
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the reply's text (and logprobs) start with the prompt's
    suffix: str | None = None  # refused (`unsupported`)

    def prompts(self) -> list[str | list[int]]:
        """The batch: a string, or a list of token ids, is one prompt; a list of strings or
        of token-id lists is one prompt each (a choice each, in order, as OpenAI's API)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequest("prompt: an empty list", param="prompt")
        # the strict union has made a list all ints, all strings or all lists: its first says which
        if isinstance(p[0], int):
            return [list(p)]
        if any(len(x) == 0 for x in p):
            raise BadRequest("prompt: an empty prompt in the batch", param="prompt")
        return list(p)

    def _unsupported(self) -> list[tuple[str, bool]]:
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens: 0 is allowed only with echo (to score the prompt)", param="max_tokens")
        return [("suffix", bool(self.suffix))]

    def sampling(self) -> SamplingParams:
        return self.params(self.max_tokens, self.logprobs, self.logprobs if self.echo else None)


class ContentPart(_Body):
    type: str
    text: str | None = None

    def checked(self) -> str:
        if self.type != "text":
            raise BadRequest(f"messages: content parts of type {self.type!r} are not supported "
                             "(this server takes text only)", param="messages.content", code="unsupported_parameter")
        if self.text is None:
            raise BadRequest("messages: a text content part without `text`", param="messages.content")
        return self.text


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.checked() for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    add_special_tokens: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's (the last message before the reply): refused
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def _unsupported(self) -> list[tuple[str, bool]]:
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs: only allowed with logprobs: true", param="top_logprobs")
        return [("echo", self.echo), ("tools", bool(self.tools)),
                ("tool_choice", self.tool_choice not in (None, "none"))]

    def sampling(self) -> SamplingParams:
        return self.params(self.wanted_tokens(), (self.top_logprobs or 0) if self.logprobs else None)

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
