"""What the engine core reports after each step, as small typed values.

One `EngineCoreOutputs` per step: the new token of every streamed request that sampled
(parallel lists, one row per request), and the requests that started, finished or were
refused. The offline LLM reads it in process; the server's engine-core process sends it
as one msgpack message per step (msgspec structs: typed and validated on decode, never
pickle). Text is not the engine's business: the front end detokenizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from rlserve.errors import WireError, from_wire, to_wire
from rlserve.sampling_params import InvalidRequestError
from rlserve.sequence import TokenLogprob

# vllm:iteration_tokens_total's buckets (tokens a step produced, prompts counted whole at
# their first token), as vLLM's.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Started(msgspec.Struct, array_like=True, omit_defaults=True):
    """A streamed request's first token came this step: what the prompt cost."""

    request_id: str
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None


class FinalTokens(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything a non-streamed request produced, sent once when it finishes."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    # [version, start, end): output tokens [start, end) came from weights of `version`
    version_spans: list[tuple[int, int, int]]
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None


class RequestTiming(msgspec.Struct, array_like=True):
    """Where a finished request's time went in the engine (vLLM's request phases), in
    seconds on the engine's clock. Sent once, with Finished: nothing per token."""

    queued: float  # arrived at the engine -> first scheduled
    prefill: float  # first scheduled -> first token
    decode: float  # first token -> last token
    inference: float  # first scheduled -> last token
    # first token -> when this was sent (-1: no token): the front end's TTFT of a request
    # whose tokens come all at once is its latency less this
    since_first_token: float
    num_preemptions: int


class RoutedExperts(msgspec.Struct, array_like=True):
    """A finished request's routes (routing replay): int32 [tokens, num_hidden_layers,
    top_k], packed, one message for the whole request."""

    data: bytes  # int32, native byte order
    shape: tuple[int, int, int]

    @classmethod
    def pack(cls, routes: np.ndarray) -> RoutedExperts:
        rows, layers, k = routes.shape
        return cls(np.ascontiguousarray(routes, dtype=np.int32).tobytes(), (rows, layers, k))

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.int32).reshape(self.shape).copy()  # writable, the user's


def check_return_routed_experts(wanted: bool | None, moe: bool, capturing: bool) -> None:
    """A request that asks for routes the engine cannot give is refused, naming the field."""
    if not wanted:
        return
    if not moe:
        raise InvalidRequestError("return_routed_experts: the model has no mixture-of-experts layers, "
                                  "so there are no routed experts to return", "return_routed_experts")
    if not capturing:
        raise InvalidRequestError("return_routed_experts: the engine does not record routes; start it "
                                  "with --enable-return-routed-experts", "return_routed_experts")


class Finished(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    reason: str  # stop | length | abort
    stop_reason: int | None = None  # the stop token id, when one ended it (not eos)
    final: FinalTokens | None = None  # non-streamed requests only
    timing: RequestTiming | None = None
    # enable_return_routed_experts: a row per token that went through the model
    routed_experts: RoutedExperts | None = None


class Rejected(msgspec.Struct, array_like=True):
    """The engine refused a request it was sent (the front end validates first)."""

    request_id: str
    message: str
    param: str | None
    error_type: str = "InvalidRequestError"  # its class (rlserve/errors.py): its status with it

    @classmethod
    def of(cls, request_id: str, e: BaseException) -> Rejected:
        w = to_wire(e)
        return cls(request_id, w.message, w.param, w.type)

    def error(self) -> BaseException:
        """The refusal, raised again in the front end as the engine's own type."""
        return from_wire(WireError(self.error_type, self.message, self.param))


class EngineStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_cache_capacity_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    aborted_total: int
    preemptions_total: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int
    weight_version: int
    paused: bool
    sleeping: bool
    sleep_level: int = 0  # 0 awake; 1: weights offloaded; 2: weights dropped
    weight_label: str | None = None  # the label weight_version is served under, if any
    asleep: list[str] = []  # what sleeps: "weights", "kv_cache" (or "scheduling": level 0)
    # Of num_waiting, those held back by something other than room (vLLM's "deferred"):
    # a grammar still compiling, or no LoRA slot free.
    num_waiting_deferred: int = 0
    # vllm:iteration_tokens_total: per-bucket counts (ITERATION_TOKENS_BUCKETS, then +Inf), sum
    iteration_tokens: list[int] = []
    iteration_tokens_sum: int = 0

    @classmethod
    def merge(cls, stats: list[EngineStats], serving: list[EngineStats]) -> EngineStats:
        """Several replicas' stats as one engine's: counts add up, the cache usage is
        weighted by capacity, and the version is the oldest that `serving` replicas serve."""
        total = lambda name: sum(getattr(s, name) for s in stats)  # noqa: E731
        capacity = total("kv_cache_capacity_tokens")
        return cls(
            num_running=total("num_running"), num_waiting=total("num_waiting"),
            kv_cache_usage=sum(s.kv_cache_usage * s.kv_cache_capacity_tokens for s in stats) / max(capacity, 1),
            kv_cache_capacity_tokens=capacity, prompt_tokens_total=total("prompt_tokens_total"),
            generation_tokens_total=total("generation_tokens_total"),
            aborted_total=total("aborted_total"), preemptions_total=total("preemptions_total"),
            prefix_cache_queries=total("prefix_cache_queries"),
            prefix_cache_hit_tokens=total("prefix_cache_hit_tokens"),
            weight_version=min(s.weight_version for s in serving),
            paused=any(s.paused for s in stats), sleeping=any(s.sleeping for s in stats),
            sleep_level=max(s.sleep_level for s in stats),
            weight_label=min(serving, key=lambda s: s.weight_version).weight_label if serving else None,
            asleep=sorted({t for s in stats for t in s.asleep}),
            num_waiting_deferred=total("num_waiting_deferred"),
            iteration_tokens=[sum(c) for c in zip(*(s.iteration_tokens for s in stats))],
            iteration_tokens_sum=total("iteration_tokens_sum"))


class EngineCoreOutputs(msgspec.Struct, array_like=True, tag="step"):
    version: int  # the weights this step's tokens came from
    request_ids: list[str] = []  # streamed requests that sampled, one row each
    token_ids: list[int] = []
    logprobs: list[TokenLogprob | None] | None = None  # None: no row asked for logprobs
    started: list[Started] = []
    finished: list[Finished] = []
    rejected: list[Rejected] = []
    stats: EngineStats | None = None
    timestamp: float = 0.0  # the engine's clock when the step's tokens were read back
    label: str | None = None  # the label `version` is served under, if it has one

    def __bool__(self) -> bool:
        return bool(self.request_ids or self.started or self.finished or self.rejected)


class StepOut:
    """What a step produced, gathered as its tokens are accepted (engine/step_tokens.py)."""

    __slots__ = ("ids", "tokens", "logprobs", "any_logprobs", "started", "finished", "rejected")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.any_logprobs = False
        self.started: list[Started] = []
        self.finished: list[Finished] = []
        self.rejected: list[Rejected] = []

    def build(self, version: int, timestamp: float = 0.0) -> EngineCoreOutputs | None:
        if not (self.ids or self.finished or self.started or self.rejected):
            return None
        return EngineCoreOutputs(version, self.ids, self.tokens,
                                 self.logprobs if self.any_logprobs else None,
                                 self.started, self.finished, self.rejected, timestamp=timestamp)


def merge_outputs(a: EngineCoreOutputs | None, b: EngineCoreOutputs | None) -> EngineCoreOutputs | None:
    """Two step outputs as one (b's version wins)."""
    if a is None or b is None:
        return a or b
    b.started[:0] = a.started
    b.finished[:0] = a.finished
    b.rejected[:0] = a.rejected
    return b


# Which weights produced which output tokens: the engine records a version per token, the
# front end reports them as spans.
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
