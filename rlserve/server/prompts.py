"""A request's prompt as token ids: text through the tokenizer, chat messages through the
chat template, token ids checked against the vocabulary and decoded back (echo, detokenize)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlserve import json_depth
from rlserve.sampling_params import InvalidRequestError
from rlserve.server.limits import LARGE_TEXT_CHARS
from rlserve.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeChatRequest


@dataclass
class Prompt:
    token_ids: list[int]
    text: str


class PromptRenderer:
    """The tokenizer and chat template as the routes use them; every failure names the field."""

    def __init__(self, tokenizer: Any, vocab_size: int, chat_template: str | None):
        self.tokenizer = tokenizer  # None with --skip-tokenizer-init
        self.vocab_size = vocab_size
        self.chat_template = chat_template  # --chat-template, else the tokenizer's

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        for t in ids:
            if t >= self.vocab_size:
                raise InvalidRequestError(
                    f"{param}: token id {t} is out of vocabulary (ids 0 to {self.vocab_size - 1})", param
                )

    def _no_tokenizer(self, param: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"{param}: text needs the tokenizer, and this server runs with --skip-tokenizer-init: send token ids", param
        )

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if self.tokenizer is None:
            raise self._no_tokenizer(param)
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, ValueError) as e:  # e.g. lone surrogates the tokenizer refuses
            raise InvalidRequestError(f"{param}: cannot be tokenized ({e})", param) from e

    async def encode_async(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """`encode`, on a thread when the text is long: the event loop keeps serving."""
        if len(text) < LARGE_TEXT_CHARS:
            return self.encode(text, add_special_tokens, param)
        return await asyncio.to_thread(self.encode, text, add_special_tokens, param)

    def decode(self, ids: Sequence[int], param: str) -> str:
        self.check_ids(ids, param)
        if self.tokenizer is None:  # vLLM's --skip-tokenizer-init: token ids only, no text
            return ""
        try:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidRequestError(f"{param}: cannot be decoded ({e})", param) from e

    def render_chat(self, body: ChatCompletionRequest | TokenizeChatRequest) -> str:
        """The conversation through the chat template: messages as given (tool calls, tool
        results and reasoning included), the tools, documents and template variables."""
        if body.add_generation_prompt and body.continue_final_message:
            raise InvalidRequestError(
                "continue_final_message: cannot be combined with add_generation_prompt", "continue_final_message"
            )
        if self.tokenizer is None:
            raise self._no_tokenizer("messages")
        template = self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "messages: this model has no chat template; start the server with --chat-template", "messages"
            )
        conversation = [_template_message(m, i) for i, m in enumerate(body.messages)]
        kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        if body.documents is not None:
            kwargs["documents"] = body.documents
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                **kwargs,
            )
        except Exception as e:  # template errors are caused by the messages sent
            raise InvalidRequestError(f"messages: the chat template failed: {e}", "messages") from e

    def chat_prompt(self, body: ChatCompletionRequest | TokenizeChatRequest) -> Prompt:
        text = self.render_chat(body)
        # The template already wrote the special tokens it wants (add_special_tokens: more).
        return Prompt(self.encode(text, body.add_special_tokens, "messages"), text)

    async def chat_prompt_async(self, body: ChatCompletionRequest | TokenizeChatRequest) -> Prompt:
        """`chat_prompt`, on a thread when the messages are long."""
        size = sum(
            len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or [])
            for m in body.messages
        )
        if size < LARGE_TEXT_CHARS:
            return self.chat_prompt(body)
        return await asyncio.to_thread(self.chat_prompt, body)


def _template_message(m: ChatMessage, index: int) -> dict[str, Any]:
    """One message as chat templates read it. Tool-call arguments become objects, as
    transformers' templates expect (OpenAI sends them as JSON text); `reasoning` (vLLM's
    newer name) is also given as `reasoning_content`, which templates read."""
    content = m.content
    if isinstance(content, list):  # text parts only: the schema refuses others
        content = "".join(p.text for p in content)
    entry: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.name is not None:
        entry["name"] = m.name
    if m.tool_calls is not None:
        calls = []
        for j, call in enumerate(m.tool_calls):
            args = call.function.arguments
            if isinstance(args, str):
                param = f"messages.{index}.tool_calls.{j}.function.arguments"
                try:
                    args = json_depth.loads(args) if args.strip() else {}
                except json_depth.JSONTooDeepError as e:
                    raise InvalidRequestError(f"{param}: {e}", "messages") from None
                except ValueError as e:
                    raise InvalidRequestError(f"{param}: not valid JSON ({e})", "messages") from None
            fn = {"name": call.function.name, "arguments": args}
            calls.append({"type": "function", "function": fn, **({"id": call.id} if call.id else {})})
        entry["tool_calls"] = calls
    if m.tool_call_id is not None:
        entry["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        entry["reasoning_content"] = entry["reasoning"] = reasoning
    return entry
