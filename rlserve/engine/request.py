"""The engine's request: a Sequence (rlserve.sequence: what the model runner reads) with the
scheduler's and the outputs' state added; SamplingParams are rlserve.sampling_params. The
checks a prompt passes are rlserve.wire.validation, what a caller gets back
rlserve.frontend.request_output."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlserve.sequence import Sequence, TokenLogprob
from rlserve.wire.validation import check_cache_salt

if TYPE_CHECKING:
    from concurrent.futures import Future

    from rlserve.engine.structured_output import CompiledGrammar, GrammarMatcher


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


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
        self.kv_capacity = 0  # tokens its KV blocks hold (KVCacheManager keeps it)
        # Structured outputs: the grammar's compile (a Future), then the request's matcher.
        self.grammar: Future[CompiledGrammar] | None = None
        self.matcher: GrammarMatcher | None = None
        # Fixed for the request's life, read for every token: computed once.
        max_tokens = self.sampling_params.max_tokens
        room = self.max_model_len - self.num_prompt_tokens
        self.max_output_tokens = room if max_tokens is None else min(max_tokens, room)
        self.last_index = self.num_prompt_tokens + self.max_output_tokens - 1  # of its last token
