"""Requests and their outputs: the small typed values that flow through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

MAX_LOGPROBS = 20


class InvalidRequestError(ValueError):
    """A user error. `param` names the offending field; the server turns this into a 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineUnavailableError(RuntimeError):
    """Generation cannot run now, for a reason the caller can wait out (HTTP 503)."""


@dataclass
class SamplingParams:
    """How to sample. Field names and meanings follow vLLM's SamplingParams.

    Logprobs are those of the model's raw distribution (log_softmax of the logits, before
    temperature, top-k/p/min-p), which is what RL importance ratios need.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; k >= 0: sampled token plus top-k alternatives
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        def bad(param: str, message: str) -> None:
            raise InvalidRequestError(f"{param}: {message}", param)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1 (disabled) or at least 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                bad(name, f"must be between 0 and {MAX_LOGPROBS}, got {value}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            bad("seed", "must fit in a signed 64-bit integer")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine's id of each of a prompt's n samples."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def validate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                    vocab_size: int) -> None:
    """What a prompt must satisfy to run; the front end checks before sending, the engine again."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt: must contain at least one token", "prompt")
    if n >= max_model_len:
        raise InvalidRequestError(
            f"prompt: {n} tokens, but max_model_len is {max_model_len} (the prompt "
            "and at least one generated token must fit)", "prompt")
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"max_tokens: the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) "
            f"exceeds max_model_len ({max_model_len})", "max_tokens")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
    for t in params.stop_token_ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})", "stop_token_ids")


class TokenLogprob(NamedTuple):
    """Logprob of one sampled token, with its rank and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


class FinishReason(str, enum.Enum):
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
class Request:
    """One sequence being generated. A prompt with n > 1 becomes n requests of one group."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 2048
    group_id: str | None = None  # parent id when n > 1
    sample_index: int = 0
    stream: bool = False  # report every token as it comes, not all of them at the end
    arrival_time: float = field(default_factory=time.monotonic)
    # Prefix-cache isolation (vLLM's name): only requests with the same salt share blocks.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first schedule
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.token_versions: list[int] = []  # weight version that produced each output token
        self.num_preemptions = 0
        self.paused_kept = False
        self.kv_capacity = 0  # tokens its KV blocks hold (KVCacheManager keeps it)
        # Fixed for the request's life, read for every token: computed once.
        p = self.sampling_params
        room = self.max_model_len - self.num_prompt_tokens
        self.max_output_tokens = room if p.max_tokens is None else min(p.max_tokens, room)
        self.last_index = self.num_prompt_tokens + self.max_output_tokens - 1  # of its last token
        # Tokens that can end the request (subject to min_tokens).
        self.stop_ids = frozenset(p.stop_token_ids).union(() if p.ignore_eos else self.eos_token_ids)
        # The sampler's per-row parameters (see ModelRunner._sampling_params). A top_k
        # beyond any vocabulary means all of it, as 0 does.
        self.sampling_row = (p.temperature, p.top_p, p.min_p, min(max(p.top_k, 0), 1 << 31),
                             p.seed is not None, p.min_tokens,
                             -1 if p.logprobs is None else p.logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


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
