"""Response bodies of the OpenAI-compatible API, and its errors, as pydantic models.

Names and shapes follow OpenAI's API and vLLM's answers; a field outside OpenAI's schema
(an `Extension`) is left out of the JSON while unset, as vLLM leaves out its nulls.
"""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, Field

from rlserve.errors import StatusError
from rlserve.server.routes_json import RoutesField


def _omit_none(value: Any) -> bool:
    return value is None


def Extension(default: Any = None, description: str | None = None) -> Any:  # noqa: N802
    """A response field outside OpenAI's schema: left out of the JSON while unset."""
    return Field(default, description=description, exclude_if=_omit_none)


class _Response(BaseModel):
    pass



# vLLM's error types by status; others take the status's phrase, as vLLM's HTTP errors do.
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
               501: "NotImplementedError", 503: "ServiceUnavailableError"}


def error_type(status: int, phrase: bool = False) -> str:
    """vLLM's type for an error of `status`; `phrase`: the status's phrase, as vLLM types
    the errors of its HTTP layer (unknown route, wrong method)."""
    try:
        return (None if phrase else ERROR_TYPES.get(status)) or HTTPStatus(status).phrase
    except ValueError:  # not a status http.HTTPStatus knows
        return "Error"


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None  # the HTTP status, as vLLM sends it (401: OpenAI's string)


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
    """Output tokens [start, end) of a choice were sampled with weights of `version`: a
    string in `weight_versions` (vLLM's, the label /weight_info reports), an integer in
    `weight_version_spans` (rlserve's older field)."""

    version: str | int
    start: int
    end: int


# vLLM's routed_experts of a choice: [prompt + output tokens - 1][num_hidden_layers][top_k]
# expert ids, with its end (null when the server does not record routes, or the request
# set return_routed_experts: false)
RoutedExpertsField = RoutesField  # a RoutesJSON (server/routes_json.py): the JSON text, written fast
ROUTED_EXPERTS: Any = Field(None, description="The experts each token went to at every layer "
                                              "(--enable-return-routed-experts), with the choice's end.")


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's Logprob: one token's logprob at a prompt position."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token there
    decoded_token: str | None = None


# One entry per prompt token: None for the first (nothing predicts it), else the prompt
# token and the top alternatives, keyed by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionStreamChoice(_Response):
    """A choice of a streamed chunk; vLLM's fields are sent as null when unset."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = Field(
        None, description="The stop string or token id that ended the choice.")
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpan] | None = Extension()
    weight_version_spans: list[WeightVersionSpan] | None = Extension()
    # Only in a choice's last chunk (vLLM's stream choice has no such field: left out while unset)
    routed_experts: RoutedExpertsField = Extension()


class CompletionChoice(CompletionStreamChoice):
    prompt_logprobs: PromptLogprobs | None = None
    routed_experts: RoutedExpertsField = ROUTED_EXPERTS


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = Extension()
    weight_version: int


class CompletionResponse(CompletionStreamResponse):
    created: int = Field(default_factory=lambda: int(time.time()))
    choices: list[CompletionChoice]  # type: ignore[assignment]
    weight_version: int = Field(description="Weight version of the latest tokens in this body.")


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprobEntry] | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = Extension()
    reasoning: str | None = Field(None, description="the thinking, split from the answer by "
                                                    "--reasoning-parser (null without one)")
    reasoning_content: str | None = Extension(description="reasoning's older name, as vLLM also sends it")


ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpan] | None = Extension()
    weight_version_spans: list[WeightVersionSpan] | None = Extension()
    routed_experts: RoutedExpertsField = ROUTED_EXPERTS


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = Extension()
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    weight_version: int


class DeltaFunctionCall(_Response):
    name: str | None = Extension()
    arguments: str | None = Extension()


class DeltaToolCall(_Response):
    """A piece of a streamed tool call: the first carries id, type and name; the
    `arguments` of all pieces of one index concatenate to the call's JSON arguments."""

    index: int
    id: str | None = Extension()
    type: Literal["function"] | None = Extension()
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = Extension()
    content: str | None = Extension()
    reasoning: str | None = Extension()
    reasoning_content: str | None = Extension()
    tool_calls: list[DeltaToolCall] | None = Extension()


class ChatChunkChoice(_Response):
    """Chunks are sent with only the fields set (as vLLM sends them): stop_reason in a
    choice's last chunk, token_ids in each chunk with tokens, as null when not asked for."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpan] | None = Extension()
    weight_version_spans: list[WeightVersionSpan] | None = Extension()
    routed_experts: RoutedExpertsField = ROUTED_EXPERTS


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Extension()
    prompt_token_ids: list[int] | None = None  # the first chunk's
    weight_version: int


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rlserve"
    root: str
    parent: str | None = Field(None, description="a LoRA adapter's base model")
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


class APIError(Exception):
    """Raised anywhere in the HTTP layer; the app turns it into an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: int | str | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type or error_type(status), param=param,
                              code=status if code is None else code)

    @property
    def body(self) -> ErrorResponse:
        return ErrorResponse(error=self.info)

    @classmethod
    def of(cls, e: StatusError) -> APIError:
        """An error of rlserve/errors.py as the answer its class names (status, type, message)."""
        return cls(e.http_status, e.message_prefix + str(e), type=e.error_type, param=e.param)
