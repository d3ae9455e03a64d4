"""Request bodies of the OpenAI-compatible API, as pydantic models (responses.py: the answers).

Names, defaults and shapes follow OpenAI's API. The extensions RL rollouts need (top_k,
min_p, ignore_eos, min_tokens, return_token_ids, return_weight_versions, ...) and vLLM's
sampling and structured-output fields sit in the request body next to them, as vLLM does
it, so `extra_body=` of the openai client works.

Every field a body carries either works or is refused with a 400 naming it: unknown fields
are refused (`extra="forbid"`), and the fields of vLLM's schemas that rlserve does not
implement are refused with the reason (rlserve/server/unimplemented.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlserve.sampling_params import MAX_LOGIT_BIAS
from rlserve.server import unimplemented
from rlserve.server.unimplemented import Unimplemented

INT32_MAX = 2**31 - 1
MAX_N = 128  # OpenAI's limit on samples per prompt

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, strict=True)]


class _Request(BaseModel):
    # Unknown fields are refused: a field this server does not know would otherwise be
    # silently dropped, and a rollout would run without what it asked for. Types are strict
    # ("true" is not a bool, 1.5 is not an int), and NaN or infinities never reach the sampler.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    # vLLM's fields this model does not implement: accepted only with a neutral value.
    unimplemented_fields: ClassVar[Mapping[str, Unimplemented]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return unimplemented.drop_neutral(data, cls.unimplemented_fields)


class StreamOptions(_Request):
    unimplemented_fields = unimplemented.STREAM_OPTIONS
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="With include_usage: every chunk "
                                                            "carries its choice's usage so far.")


NonEmptyStr = Annotated[str, Field(min_length=1)]
JsonSchema = dict[str, Any]


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    # `schema` is OpenAI's name; it would shadow a BaseModel attribute, hence the alias.
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    unimplemented_fields = unimplemented.STRUCTURED_OUTPUTS
    # `json` would shadow a BaseModel attribute, hence the alias.
    json_: str | JsonSchema | None = Field(None, alias="json")
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


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
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="Subtracted from the logit of every token the output has.")
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="Subtracted from a token's logit once per time the output "
                                       "has it.")
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = Field(
        None, description="Token id (as a string) -> added to its logit.")
    response_format: ResponseFormat | None = None

    # Extensions (vLLM's names and meanings).
    repetition_penalty: float | None = Field(
        None, gt=0, description="1: off. Logits of prompt and output tokens are divided by it "
                                "when positive, multiplied when negative.")
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = Field(
        None, description="Only these tokens can be sampled.")
    bad_words: list[NonEmptyStr] | None = Field(
        None, description="Words that must not be generated (as vLLM bans them).")
    prompt_logprobs: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="Logprobs of each prompt token, with this many "
                                               "alternatives (vLLM's shape); -1: the whole vocabulary.")
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | JsonSchema | None = Field(None, description="Older name of structured_outputs.json.")
    guided_regex: NonEmptyStr | None = Field(None, description="Older name of structured_outputs.regex.")
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = Field(
        None, description="Older name of structured_outputs.choice.")
    guided_grammar: NonEmptyStr | None = Field(None, description="Older name of structured_outputs.grammar.")
    request_id: str | None = Field(
        None, min_length=1, max_length=256, description="Sets the response's id (cmpl-<id>, "
                                                        "chatcmpl-<id>).")
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
        False, description="Add per-choice weight_versions (vLLM's, versions as strings) and "
                           "weight_version_spans (rlserve's older name, integers) at the end of "
                           "each choice: which weights made which tokens.")
    logprob_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = Field(
        None, description="With logprobs: the logprobs of these tokens at every output position, "
                          "in this order, instead of the most likely ones.")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="Keep only the prompt's last N tokens (-1: "
                                               "max_model_len of them).")
    cache_salt: str | None = Field(
        None, min_length=1, description="Prefix-cache isolation: blocks are shared only with "
                                        "requests of the same salt.")
    return_routed_experts: bool | None = Field(
        None, description="SGLang's name: false skips this request's routed_experts; true "
                          "requires them (400 on a dense model or without "
                          "--enable-return-routed-experts); default: the server's flag.")


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    unimplemented_fields = unimplemented.COMPLETION
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1: the whole vocabulary.")
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    return_tokens_as_token_ids: bool | None = Field(
        None, description="Logprob tokens as 'token_id:<id>', which never collide (default: "
                          "the server's --return-tokens-as-token-ids).")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (e.g. BOS) "
                                                       "to text prompts.")


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: NonEmptyStr
    arguments: str | dict[str, Any] = Field(description="JSON text, as OpenAI sends it (or an object).")


class ToolCall(_Request):
    """A tool call in the conversation's history (an assistant message's tool_calls)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """A message as the chat template receives it; tool-call history included."""

    unimplemented_fields = unimplemented.MESSAGE
    role: NonEmptyStr
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="Newer name of reasoning_content.")


class FunctionDefinition(_Request):
    name: NonEmptyStr
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: NonEmptyStr


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingRequest):
    unimplemented_fields = unimplemented.CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="Deprecated alias.")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    # Bounded by --max-logprobs (a 400 naming `logprobs`, as vLLM names it).
    top_logprobs: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1: the whole vocabulary.")
    tools: Annotated[list[ToolDefinition], Field(min_length=1)] | None = None
    tool_choice: ToolChoice | None = Field(
        None, description="Default: auto when tools are given, else none.")
    parallel_tool_calls: bool | None = Field(None, description="False: one tool call at most.")
    # Extensions, as in vLLM.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = Field(False, description="Add the tokenizer's special tokens on top "
                                                        "of what the chat template writes.")
    documents: list[dict[str, str]] | None = Field(None, description="Passed to the chat template.")
    chat_template_kwargs: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    include_reasoning: bool = Field(True, description="False: the reasoning --reasoning-parser "
                                                      "splits off is dropped, not returned")


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch: `messages` is a list of conversations, each
    answered as one choice (index i for conversation i). Not streamed, no tools, n = 1."""

    messages: Annotated[list[Annotated[list[ChatMessage], Field(min_length=1)]],  # type: ignore[assignment]
                        Field(min_length=1)]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[ToolDefinition], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]
