"""The engine's request and what it returns: the small typed values that flow through the
engine. A Request is a Sequence (rlserve.sequence: what the model runner reads) with the
scheduler's and the outputs' state added; SamplingParams are rlserve.sampling_params."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rlserve.errors import EngineUnavailableError  # noqa: F401 (re-exported: raised by the engine)
from rlserve.sampling_params import InvalidRequestError, SamplingParams, check_logprobs_limit
from rlserve.sequence import Sequence, TokenLogprob

if TYPE_CHECKING:
    from concurrent.futures import Future

    from rlserve.engine.structured_output import CompiledGrammar, GrammarMatcher


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine's id of each of a prompt's n samples."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def validate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                    vocab_size: int, max_logprobs: int) -> None:
    """What a prompt must satisfy to run; the front end checks before sending, the engine again.
    `max_logprobs`: the most logprobs a request may ask for (-1: the whole vocabulary)."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt: must contain at least one token", "prompt")
    # vLLM names `input_tokens` when the prompt leaves no room for the tokens asked for.
    if n >= max_model_len:
        raise InvalidRequestError(
            f"input_tokens: the prompt has {n} tokens, but max_model_len is {max_model_len} (the "
            "prompt and at least one generated token must fit)", "input_tokens")
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"input_tokens: the prompt has {n} tokens and max_tokens asks for {params.max_tokens} "
            f"more, but max_model_len is {max_model_len}; shorten the prompt or lower max_tokens",
            "input_tokens")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:  # C speed; then find it
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(
            f"prompt: token id {bad} is out of vocabulary (ids 0 to {vocab_size - 1})", "prompt")
    for t in params.stop_token_ids or ():
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"stop_token_ids: token id {t} is out of vocabulary (ids 0 to {vocab_size - 1})",
                "stop_token_ids")
    # An id out of range would index outside the logits on the device.
    params.validate_token_ids(vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        check_logprobs_limit(name, getattr(params, name), max_logprobs, vocab_size)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


def check_cache_salt(salt: object) -> None:
    """A salt is absent (None) or a non-empty string: an empty one would look set but isolate nothing."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError(f"cache_salt: must be a non-empty string when given, got {salt!r}",
                                  "cache_salt")


@dataclass(eq=False)  # identity: the scheduler looks requests up in its queues
class Request(Sequence):
    """One sequence being generated. A prompt with n > 1 becomes n requests of one group."""

    max_model_len: int = 2048
    group_id: str | None = None  # parent id when n > 1
    stream: bool = False  # report every token as it comes, not all of them at the end
    arrival_time: float = field(default_factory=time.monotonic)
    # Prefix-cache isolation (vLLM's name): only requests with the same salt share blocks.
    cache_salt: str | None = None
    # The LoRA adapter it runs with (rlserve.engine.lora); its slot is Sequence.lora_slot.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)
        super().__post_init__()
        self.num_cached_tokens = 0  # prefix-cache hit at first schedule
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.token_versions: list[int] = []  # weight version that produced each output token
        self.num_preemptions = 0
        # The engine's clock (arrival_time's): first scheduled, first and latest token read back.
        self.scheduled_time = 0.0
        self.first_token_time = 0.0
        self.last_token_time = 0.0
        self.paused_kept = False
        self.kv_capacity = 0  # tokens its KV blocks hold (KVCacheManager keeps it)
        # Structured outputs: the grammar's compile (a Future), then the request's matcher.
        self.grammar: Future[CompiledGrammar] | None = None
        self.matcher: GrammarMatcher | None = None
        # Fixed for the request's life, read for every token: computed once.
        max_tokens = self.sampling_params.max_tokens
        room = self.max_model_len - self.num_prompt_tokens
        self.max_output_tokens = room if max_tokens is None else min(max_tokens, room)
        self.last_index = self.num_prompt_tokens + self.max_output_tokens - 1  # of its last token


@dataclass
class VersionSpan:
    """Output tokens [start, end) were produced by weights of `version`."""

    version: int
    start: int
    end: int


def version_spans(token_versions: list[int]) -> list[VersionSpan]:
    spans: list[VersionSpan] = []
    for i, v in enumerate(token_versions):
        if spans and spans[-1].version == v:
            spans[-1].end = i + 1
        else:
            spans.append(VersionSpan(v, i, i + 1))
    return spans


@dataclass
class CompletionOutput:
    """One sample of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_versions: list[int] = field(default_factory=list)
    # enable_return_routed_experts (vLLM's field): int32 [prompt + output tokens - 1,
    # num_hidden_layers, top_k], the experts of every token that went through the model
    routed_experts: np.ndarray | None = None
    # LLM.chat with a reasoning_parser: `text` split into the thinking and the answer.
    reasoning: str | None = None
    content: str | None = None

    @property
    def weight_version_spans(self) -> list[VersionSpan]:
        return version_spans(self.token_versions)

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    """All samples of one prompt, as the offline API and the server return them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    weight_version: int = 0
    num_cached_tokens: int = 0
