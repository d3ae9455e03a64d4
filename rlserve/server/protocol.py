"""Bodies of the OpenAI-compatible API, as pydantic models.

Names, defaults and shapes follow OpenAI's API. The extensions RL rollouts need (top_k,
min_p, ignore_eos, min_tokens, return_token_ids, return_weight_versions, ...) sit in the
request body next to them, as vLLM does it, so `extra_body=` of the openai client works.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlserve.engine.request import MAX_LOGPROBS

INT32_MAX = 2**31 - 1
MAX_N = 128  # OpenAI's limit on samples per prompt

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, strict=True)]


def _omit_none(value: Any) -> bool:
    return value is None


def Extension(default: Any = None, description: str | None = None) -> Any:  # noqa: N802
    """A response field outside OpenAI's schema: left out of the JSON while unset."""
    return Field(default, description=description, exclude_if=_omit_none)


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI does. Types are strict ("true" is not a bool,
    # 1.5 is not an int), and NaN or infinities never reach the sampler.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class _Response(BaseModel):
    pass


# ---------------------------------------------------------------- requests


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="Served model name; the served model when omitted.")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, description="0 means greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted for client compatibility; anything but the neutral value is refused (400)
    # rather than silently ignored.
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None

    # Extensions.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0: disabled.")
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = Field(
        True, description="False: token ids and logprobs only; no text is decoded (text is "
                          "empty, logprob tokens read 'token_id:<id>').")
    return_token_ids: bool = Field(
        False, description="Add prompt_token_ids and per-choice token_ids to the response.")
    return_weight_versions: bool = Field(
        False, description="Add per-choice weight_version_spans: which weights made which tokens.")
    cache_salt: str | None = Field(
        None, min_length=1, description="Prefix-cache isolation: blocks are shared only with "
                                        "requests of the same salt.")


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    return_tokens_as_token_ids: bool = Field(
        False, description="Logprob tokens as 'token_id:<id>', which never collide.")


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="Deprecated alias.")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    # Extensions, as in vLLM.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool = False


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------- responses


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Extension()


class WeightVersionSpan(_Response):
    """Output tokens [start, end) of a choice were sampled with weights of `version`."""

    version: int
    start: int
    end: int


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = Extension(
        description="The stop string or token id that ended the choice.")
    prompt_token_ids: list[int] | None = Extension()
    token_ids: list[int] | None = Extension()
    weight_version_spans: list[WeightVersionSpan] | None = Extension()


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Extension()
    weight_version: int = Field(description="Weight version of the latest tokens in this body.")


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprobEntry] | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = Extension()
    token_ids: list[int] | None = Extension()
    weight_version_spans: list[WeightVersionSpan] | None = Extension()


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = Extension()
    prompt_token_ids: list[int] | None = Extension()
    weight_version: int


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = Extension()
    content: str | None = Extension()


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = Extension()
    token_ids: list[int] | None = Extension()
    weight_version_spans: list[WeightVersionSpan] | None = Extension()


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Extension()
    prompt_token_ids: list[int] | None = Extension()
    weight_version: int


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rlserve"
    root: str
    parent: str | None = Extension(None, "a LoRA adapter's base model")
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Extension()


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


class APIError(Exception):
    """Raised anywhere in the HTTP layer; the app turns it into an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: int | str | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    @property
    def body(self) -> ErrorResponse:
        return ErrorResponse(error=self.info)
