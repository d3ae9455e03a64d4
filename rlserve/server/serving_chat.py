"""/v1/chat/completions: a conversation through the chat template -> n choices, whole or
streamed; /v1/chat/completions/batch (vLLM's): several conversations -> one choice each."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import Response

from rlserve.frontend.output_processor import RequestState, SampleDelta
from rlserve.frontend.reasoning_parsers import REASONING_PARSERS, ThinkStream, split_whole
from rlserve.sampling_params import InvalidRequestError
from rlserve.sequence import TokenLogprob
from rlserve.server.generation import Generation
from rlserve.server.prompts import Prompt
from rlserve.server.protocol import BatchChatCompletionRequest, ChatCompletionRequest
from rlserve.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatFinishReason,
    ChatLogprobs,
    DeltaMessage,
    TokenLogprobEntry,
    TopLogprob,
)
from rlserve.server.serving import OpenAIServing, finish_choice, sse, usage, usage_so_far
from rlserve.server.token_strings import floor_logprob
from rlserve.server.tool_calls import ChoiceToolCalls


def _finish_reason(reason: str | None, called: bool) -> ChatFinishReason | None:
    """A choice that ended by stopping after tool calls finished with them (OpenAI)."""
    # The engine's reasons are stop, length and abort, typed there as str.
    return "tool_calls" if reason == "stop" and called else reason  # type: ignore[return-value]


def _check_batch(body: BatchChatCompletionRequest) -> None:
    """What vLLM's batch endpoint leaves out: streaming, tools, prompt logprobs, n > 1."""
    for name, present in (("stream", body.stream), ("tools", body.tools is not None),
                          ("tool_choice", body.tool_choice not in (None, "none")),
                          ("prompt_logprobs", body.prompt_logprobs is not None)):
        if present:
            raise InvalidRequestError(f"{name}: not supported by /v1/chat/completions/batch "
                                      "(as in vLLM); use /v1/chat/completions", name)
    if body.n != 1:
        raise InvalidRequestError("n: /v1/chat/completions/batch answers one choice per "
                                  "conversation; n must be 1 (as in vLLM)", "n")


class ChatServing(OpenAIServing):
    async def create(self, body: ChatCompletionRequest, arrival: float) -> Response:
        """One conversation, or with a BatchChatCompletionRequest one per conversation."""
        lora_name = self.check_model(body.model)
        self.check_request(body)
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs set to true", "top_logprobs")
        if body.tool_choice not in (None, "none") and not body.tools:
            raise InvalidRequestError("tool_choice: needs tools", "tool_choice")
        if isinstance(body, BatchChatCompletionRequest):
            _check_batch(body)
            prompts = [self.truncate(await self.prompts.chat_prompt_async(
                body.model_copy(update={"messages": messages})), body) for messages in body.messages]
        else:
            prompts = [self.truncate(await self.prompts.chat_prompt_async(body), body)]
        k = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = self.sampling_params(body, max_tokens, k,
                                      prompt_logprobs=None if body.stream else body.prompt_logprobs)
        engine_id = f"chatcmpl-{uuid.uuid4().hex}"
        request_id = f"chatcmpl-{body.request_id}" if body.request_id else engine_id
        created = int(time.time())
        generation = Generation(self.engine, engine_id, prompts, params, arrival, body.stream,
                                body.cache_salt, lora_name, self.metrics)
        constrained = params.structured_outputs is not None
        events = (self._events(body, request_id, created, prompts[0], generation, constrained)
                  if body.stream else None)
        return await self.respond(
            generation, events,
            lambda: self._body(body, request_id, created, prompts, generation, constrained), body)

    def _thinking(self, body: ChatCompletionRequest, prompt: Prompt, constrained: bool) -> ThinkStream | None:
        """A sample's reasoning splitter (--reasoning-parser), None without one."""
        name = self.config.reasoning_parser
        if name is None:
            return None
        return REASONING_PARSERS[name].stream(prompt.text, body.chat_template_kwargs, constrained)

    def _logprobs(self, logprobs: Sequence[TokenLogprob], k: int, as_ids: bool,
                  detokenize: bool) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> TopLogprob:
            return TopLogprob(token=self.tokens.text(token_id, as_ids), logprob=floor_logprob(logprob),
                              bytes=self.tokens.bytes(token_id) if detokenize else None)

        content = []
        for lp in logprobs:
            e = entry(lp.token_id, lp.logprob)
            content.append(TokenLogprobEntry(
                token=e.token, logprob=e.logprob, bytes=e.bytes,
                top_logprobs=[entry(t, v) for t, v in lp.top.head(k)]))
        return ChatLogprobs(content=content)

    def _extras(self, body: ChatCompletionRequest, choice: ChatChoice | ChatChunkChoice,
                state: RequestState, delta: SampleDelta) -> None:
        k = -1 if body.logprob_token_ids else body.top_logprobs or 0  # the chosen ones, all of them
        choice.logprobs = (self._logprobs(delta.logprobs or [], k,
                                          self.as_token_ids(body), body.detokenize)
                           if body.logprobs else None)
        choice.token_ids = delta.token_ids if body.return_token_ids else None
        if delta.finish_reason is not None:
            finish_choice(choice, body, state, delta)

    def _body(self, body: ChatCompletionRequest, request_id: str, created: int, prompts: list[Prompt],
              generation: Generation, constrained: bool) -> ChatCompletionResponse:
        choices = []
        for i, state in enumerate(generation.states):
            for delta in state.deltas():
                thinking = self._thinking(body, prompts[i], constrained)
                reasoning, text = split_whole(thinking, delta.text) if thinking else (None, delta.text)
                content, calls = (ChoiceToolCalls(body, self.options.tool_call_parser).whole(text)
                                  if text is not None else (None, []))
                reasoning = reasoning if body.include_reasoning else None
                message = AssistantMessage(content=content, tool_calls=calls or None, reasoning=reasoning,
                                           reasoning_content=reasoning)
                choice = ChatChoice(index=i * body.n + delta.index, message=message,
                                    finish_reason=_finish_reason(delta.finish_reason, bool(calls)))
                self._extras(body, choice, state, delta)
                choices.append(choice)
        states = generation.states
        single = len(states) == 1  # a batch's prompts have no one place in the response
        return ChatCompletionResponse(
            id=request_id, created=created, model=body.model or self.model_name, choices=choices,
            usage=usage(prompts, sum(len(s.token_ids) for st in states for s in st.samples),
                        sum(st.num_cached_tokens for st in states)),
            prompt_logprobs=(self.prompt_logprobs(states[0], body.prompt_logprobs, self.as_token_ids(body))
                             if single and body.prompt_logprobs is not None else None),
            prompt_token_ids=prompts[0].token_ids if single and body.return_token_ids else None,
            weight_version=max(st.weight_version for st in states))

    async def _events(self, body: ChatCompletionRequest, request_id: str, created: int,
                      prompt: Prompt, generation: Generation, constrained: bool) -> AsyncIterator[str]:
        """Chunks carry only the fields set, as vLLM's do (see ChatChunkChoice)."""
        (state,) = generation.states
        version = max(self.engine.weight_version, state.weight_version)

        def chunk(choices: list[ChatChunkChoice], **extra: Any) -> str:
            return sse(ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created,
                                           model=body.model or self.model_name, choices=choices,
                                           weight_version=version, **extra), exclude_unset=True)

        # The role comes first, in a chunk of its own, as OpenAI sends it.
        yield "".join(chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""),
                                             logprobs=None, finish_reason=None)],
                            prompt_token_ids=prompt.token_ids if body.return_token_ids else None)
                      for index in range(body.n))
        wants_tokens = body.logprobs or body.return_token_ids
        final_usage, running_usage = self.usage_wanted(body)
        tools = [ChoiceToolCalls(body, self.options.tool_call_parser) for _ in range(body.n)]
        thinking = [self._thinking(body, prompt, constrained) for _ in range(body.n)]
        async for _ in generation.turns():
            version = max(version, state.weight_version)
            parts = []
            for delta in state.deltas():
                final = delta.finish_reason is not None
                reasoning, text = "", delta.text
                splitter = thinking[delta.index]
                if splitter is not None:
                    piece = splitter.feed(text)
                    if final:
                        last = splitter.finish()
                        piece = piece._replace(reasoning=piece.reasoning + last.reasoning,
                                               content=piece.content + last.content)
                    reasoning, text = piece.reasoning if body.include_reasoning else "", piece.content
                content, calls = tools[delta.index].stream(text, final)
                if not (reasoning or content or calls or final or (delta.token_ids and wants_tokens)):
                    continue
                choice = ChatChunkChoice(
                    index=delta.index, delta=DeltaMessage(
                        content=content or None, tool_calls=calls or None, reasoning=reasoning or None,
                        reasoning_content=reasoning or None),
                    finish_reason=_finish_reason(delta.finish_reason, tools[delta.index].called))
                self._extras(body, choice, state, delta)
                parts.append(chunk([choice], **({"usage": usage_so_far(prompt, state, delta.index)}
                                                if running_usage else {})))
            if parts:
                yield "".join(parts)
        if final_usage:
            yield chunk([], usage=usage([prompt], sum(len(s.token_ids) for s in state.samples),
                                        state.num_cached_tokens))
