"""Request fields of vLLM's (and OpenAI's) schemas that rlserve does not implement.

Every field of a request body either works or is refused with a 400 naming it; nothing is
silently dropped. A field listed here is accepted only with its neutral value (the one
that asks for nothing, e.g. `use_beam_search: false`, which scripts written for vLLM
often send explicitly); any other value is refused with the reason. Fields in no schema at
all are refused by pydantic (`extra="forbid"` on every request model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic_core import PydanticCustomError


class Unimplemented(NamedTuple):
    neutral: tuple[Any, ...]  # values that ask for nothing: accepted and dropped
    reason: str


def refuse(reason: str, *neutral: Any) -> Unimplemented:
    return Unimplemented((None, *neutral), reason)


# Both /v1/completions and /v1/chat/completions (vLLM's sampling and extra parameters).
SAMPLING = {
    "use_beam_search": refuse("beam search is not implemented", False),
    "length_penalty": refuse("it applies to beam search, which is not implemented", 1.0, 1),
    "early_stopping": refuse("it applies to beam search, which is not implemented", False),
    "watermarking": refuse("watermarking is not implemented", False),
    "spaces_between_special_tokens": refuse("special tokens are always decoded without added spaces", True),
    "truncation_side": refuse("truncate_prompt_tokens keeps the prompt's last tokens", "left"),
    "logits_processors": refuse("custom logits processors are not supported"),
    "priority": refuse("requests are scheduled first come, first served", 0),
    "session_id": refuse("sessions are not tracked"),
    "return_token_offsets": refuse("only the /render endpoints of vLLM have it", False),
    "return_mm_kwargs": refuse("multimodal inputs are not supported", True),
    "kv_transfer_params": refuse("disaggregated serving is not implemented"),
    "ec_transfer_params": refuse("disaggregated serving is not implemented"),
    "vllm_xargs": refuse("there are no custom extensions to pass them to"),
    "repetition_detection": refuse("repetition detection is not implemented"),
    "thinking_token_budget": refuse("reasoning budgets are not implemented", -1),
    "stream_interval": refuse("streams send every token as it comes", 1),
    "routed_experts_prompt_start": refuse("routed-expert data is not returned", 0),
    "structural_tag": refuse("structural tags are not implemented; use structured_outputs "
                          "(json, regex, choice, grammar)"),
    "guided_whitespace_pattern": refuse("use structured_outputs.disable_any_whitespace"),
    "guided_decoding_backend": refuse("structured outputs always use xgrammar", "auto", "xgrammar"),
}

COMPLETION = {
    **SAMPLING,
    "prompt_embeds": refuse("prompt embeddings are not supported; send text or token ids"),
}

CHAT = {
    **SAMPLING,
    "best_of": refuse("best_of exists only on /v1/completions", 1),
    "echo": refuse("chat echo is not implemented", False),
    "chat_template": refuse("a per-request chat template is not accepted; start the server with "
                         "--chat-template"),
    "media_io_kwargs": refuse("multimodal inputs are not supported"),
    "mm_processor_kwargs": refuse("multimodal inputs are not supported"),
    "reasoning_effort": refuse("reasoning controls are not implemented; pass template variables in "
                            "chat_template_kwargs"),
    "return_prompt_text": refuse("send the messages to /tokenize to see the rendered prompt", False),
    "functions": refuse("the deprecated functions API is not supported; use tools"),
    "function_call": refuse("the deprecated functions API is not supported; use tool_choice"),
    "audio": refuse("audio output is not supported"),
    "modalities": refuse("only text output is supported", ["text"]),
    "prediction": refuse("predicted outputs are not supported"),
    "store": refuse("completions are not stored", False),
    "metadata": refuse("completions are not stored"),
    "service_tier": refuse("there is one service tier", "auto", "default"),
    "web_search_options": refuse("web search is not available"),
    "verbosity": refuse("verbosity controls are not implemented"),
    "prompt_cache_key": refuse("prefix caching needs no key; cache_salt isolates it"),
    "safety_identifier": refuse("no safety system uses it"),
}

STRUCTURED_OUTPUTS = {
    "disable_fallback": refuse("there is one backend, xgrammar", False),
    "disable_additional_properties": refuse("write additionalProperties: false into the schema", False),
    "whitespace_pattern": refuse("use disable_any_whitespace"),
    "structural_tag": refuse("structural tags are not implemented"),
    "backend": refuse("structured outputs always use xgrammar", "auto", "xgrammar"),
}

STREAM_OPTIONS = {
    "include_obfuscation": refuse("stream chunks are never padded", False),
}

# Fields of an assistant message the OpenAI client echoes back from a response: accepted
# while empty.
MESSAGE = {
    "refusal": refuse("a refusal cannot be passed back to the chat template"),
    "annotations": refuse("annotations cannot be passed back to the chat template", []),
    "audio": refuse("audio messages are not supported"),
    "function_call": refuse("the deprecated functions API is not supported; use tool_calls"),
}


def drop_neutral(data: Any, table: Mapping[str, Unimplemented]) -> Any:
    """`data` (a raw request body) without the listed fields that hold a neutral value;
    raises the 400 for the first that holds another."""
    if not isinstance(data, dict) or not table or not any(k in table for k in data):
        return data
    kept = {}
    for key, value in data.items():
        entry = table.get(key)
        if entry is None:
            kept[key] = value
        elif not any(value == n and type(value) is type(n) or value is n for n in entry.neutral):
            raise PydanticCustomError(
                "unimplemented", "not supported by rlserve ({reason})",
                {"field": key, "reason": entry.reason})
    return kept
