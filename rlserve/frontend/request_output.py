"""What the offline LLM and the server hand back for a prompt: its samples' text, tokens,
logprobs and the weight versions that produced them (vLLM's RequestOutput and
CompletionOutput), built by the output processor from the engine's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rlserve.sequence import TokenLogprob
from rlserve.wire.outputs import VersionSpan, version_spans


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
