"""Request records: the tokenized sample the scheduler receives, and its live state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

MAX_LOGPROBS = 20  # top alternatives a row may ask for (OpenAI's and vLLM's default limit)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    # max_new_tokens becomes what the context and the KV pool leave after the prompt,
    # once the prompt's length is known (a chat request without max_tokens)
    fill_context: bool = False
    # Log-probabilities (vLLM's semantics): None = none; k >= 0 = each sampled token's own
    # logprob and the k most likely alternatives. prompt_logprobs: the same for every prompt
    # token after the first (what `echo` scores); such a request takes no prefix-cache hit.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logit processing before the draw (vLLM's semantics, scheduler/model/penalties.py):
    # penalties on tokens already in the output (frequency: per occurrence; presence: once) and,
    # for repetition, in the prompt too (a logit divided by it if positive, else multiplied);
    # a bias per token id; EOS and stop_token_ids banned until min_tokens are out.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # each ends the output as EOS does (its text left out)
    # Any of logprobs, logit processing or stop tokens asked: one field a round reads per row,
    # so a batch that asks for none pays one attribute read a row for all of it (__post_init__)
    extras: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extras", self.wants_logprobs or self.adjusts_logits or bool(self.stop_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS} (got {k})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2 (got {getattr(self, name)})")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        if self.min_tokens < 0 or (self.min_tokens > self.max_new_tokens and not self.fill_context):
            raise ValueError(f"min_tokens must be between 0 and max tokens {self.max_new_tokens} (got {self.min_tokens})")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be between -100 and 100")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or self.prompt_logprobs is not None

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def needs_logits_rank(self) -> bool:
        """Asks for what only the rank holding the logits can do (rank 0 here)."""
        return self.wants_logprobs or self.adjusts_logits

    def token_ids(self) -> list[int]:
        """The token ids it names (logit_bias, stop_token_ids): the engine checks the vocabulary."""
        return [t for t, _ in self.logit_bias] + list(self.stop_token_ids)


class TokenLogprob(NamedTuple):
    """One position's log-probabilities, raw (log_softmax of the model's logits, before
    temperature and top-p): the token's own, and the `len(top_ids)` most likely tokens."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class ReqSample:
    """What the tokenizer pool hands the scheduler: already tokenized, with a unique id.

    valid_len is the true token count before any padding; block counts and
    attention extents are computed from it, never from a padded length.
    """

    request_id: str
    input_ids: list[int]
    valid_len: int
    sampling_params: SamplingParams
    arrival_ns: int
    tokenized_ns: int = 0
    error: str = ""  # set when tokenization failed; the scheduler rejects the request

    def refusal(self, vocab_size: int, context: int, logits_on_rank0: bool) -> str:
        """Why the engine cannot run this request ("" when it can)."""
        sp = self.sampling_params
        if self.error:
            return self.error
        if self.valid_len == 0:
            return "empty prompt"
        if not logits_on_rank0 and sp.needs_logits_rank:
            return "logprobs, penalties, logit_bias and min_tokens need the logits on rank 0: not with --pp > 1"
        named = sp.token_ids()
        if max(self.input_ids) >= vocab_size or min(self.input_ids) < 0 or named:
            bad = next((t for t in (*self.input_ids, *named) if not 0 <= t < vocab_size), None)
            if bad is not None:
                return f"token id {bad} is outside the vocabulary of {vocab_size}"
        if self.valid_len + sp.max_new_tokens > context:
            return (f"prompt of {self.valid_len} tokens + {sp.max_new_tokens} new tokens exceeds the model's "
                    f"context of {context} (max_position_embeddings)")
        return ""


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    EOS = "eos"
    STOP_TOKEN = "stop_token"  # one of the request's stop_token_ids
    LENGTH = "length"
    ABORTED = "aborted"
    REJECTED = "rejected"


# eq=False: a request is an entity, equal only to itself. The generated field-by-field
# __eq__ made every `req in running` scan compare whole requests: 4.2 M calls, a third of
# the scheduling thread's time on 512 requests (bench/bench_ab.py's profile, BENCHMARKS.md).
@dataclass(slots=True, eq=False)
class Request:
    sample: ReqSample
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Tokens of prompt + output whose K/V is in the cache. The request is
    # decoding exactly when one token (the last sampled one) is not yet computed.
    num_computed: int = 0
    num_cached_prefix: int = 0
    # Prefix-sharing bookkeeping: leading blocks already published and the
    # chain hash of the last one (see MemoryManager.register_full_blocks).
    num_hashed_blocks: int = 0
    last_block_hash: int = -1
    finish_reason: FinishReason | None = None
    finish_detail: str = ""
    queued_ns: int = 0
    wait_since_ns: int = 0  # entered the waiting queue (again, after a preemption)
    admitted_ns: int = 0
    first_scheduled_ns: int = 0
    # the last time it moved while running: each admission, each prefill chunk launched (a
    # token collected is token_ns); the GC's "no progress" clock, which time spent waiting
    # after a preemption must not run
    progress_ns: int = 0
    first_token_ns: int = 0
    finish_ns: int = 0
    num_preemptions: int = 0
    preempt_reasons: list[str] = field(default_factory=list)
    num_prefill_chunks: int = 0
    token_ns: list[int] = field(default_factory=list)  # when each output token was collected
    token_runs: list[int] = field(default_factory=list)  # [first_step, count, ...] of the collecting rounds
    last_event: Any = None  # end event of the last launch that touched this request (cross-stream waits)
    # prompt_logprobs: position p's entry scores prompt token p (p >= 1; [0] stays None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # sampling_params.extras, read once here: step 4 asks it of every chunk of every round
    extras: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.extras = self.sample.sampling_params.extras

    @property
    def request_id(self) -> str:
        return self.sample.request_id

    @property
    def num_tokens(self) -> int:
        return self.sample.valid_len + len(self.output_ids)

    def token_ids(self) -> list[int]:
        return self.sample.input_ids + self.output_ids

    @property
    def num_real_outputs(self) -> int:
        """Output tokens already known on the host (placeholders, ids < 0, are in flight)."""
        n = len(self.output_ids)
        while n and self.output_ids[n - 1] < 0:
            n -= 1
        return n

    def drop_placeholders(self) -> None:
        del self.output_ids[self.num_real_outputs :]

    @property
    def num_uncomputed(self) -> int:
        # written out, not through num_tokens: the policy asks this of every running request
        # every round, and a property call costs more than the arithmetic
        return self.sample.valid_len + len(self.output_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        n = len(self.output_ids)
        return n > 0 and self.sample.valid_len + n - self.num_computed == 1
