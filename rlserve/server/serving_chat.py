"""/v1/chat/completions: a conversation through the chat template -> n choices, whole or
streamed."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Sequence

from fastapi.responses import Response

from rlserve.engine.output_processor import RequestState, SampleDelta
from rlserve.sampling_params import InvalidRequestError
from rlserve.sequence import TokenLogprob
from rlserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                     DeltaMessage, TokenLogprobEntry, TopLogprob)
from rlserve.server.serving import Generation, OpenAIServing, Prompt, sse, usage, version_spans
from rlserve.server.token_strings import floor_logprob
from rlserve.server.tool_calls import ChoiceToolCalls


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that ended by stopping after tool calls finished with them (OpenAI)."""
    return "tool_calls" if reason == "stop" and called else reason


class ChatServing(OpenAIServing):
    async def create(self, body: ChatCompletionRequest, arrival: float) -> Response:
        lora_name = self.check_model(body.model)
        self.check_request(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs set to true", "top_logprobs")
        if body.tool_choice not in (None, "none") and not body.tools:
            raise InvalidRequestError("tool_choice: needs tools", "tool_choice")
        prompt = await self.chat_prompt_async(body)
        k = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = self.sampling_params(body, max_tokens, k, prompt_logprobs=body.prompt_logprobs)
        engine_id = f"chatcmpl-{uuid.uuid4().hex}"
        request_id = f"chatcmpl-{body.request_id}" if body.request_id else engine_id
        created = int(time.time())
        generation = Generation(self.engine, engine_id, [prompt], params, arrival, body.stream,
                                body.cache_salt, lora_name, self.metrics)
        events = self._events(body, request_id, created, prompt, generation) if body.stream else None
        return await self.respond(generation, events,
                                  lambda: self._body(body, request_id, created, prompt, generation), body)

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
                top_logprobs=[entry(t, v) for t, v in lp.top[:k]]))
        return ChatLogprobs(content=content)

    def _extras(self, body: ChatCompletionRequest, choice: ChatChoice | ChatChunkChoice,
                state: RequestState, delta: SampleDelta) -> None:
        if body.logprobs:
            choice.logprobs = self._logprobs(delta.logprobs or [], body.top_logprobs or 0,
                                             self.as_token_ids(body), body.detokenize)
        if body.return_token_ids:
            choice.token_ids = delta.token_ids
        if delta.finish_reason is not None:
            choice.stop_reason = delta.stop_reason
            if body.return_weight_versions:
                choice.weight_version_spans = version_spans(state.samples[delta.index].token_versions)

    def _body(self, body: ChatCompletionRequest, request_id: str, created: int, prompt: Prompt,
              generation: Generation) -> ChatCompletionResponse:
        (state,) = generation.states
        choices = []
        for delta in state.deltas():
            content, calls = ChoiceToolCalls(body, self.options.tool_call_parser).whole(delta.text)
            choice = ChatChoice(index=delta.index, message=AssistantMessage(content=content,
                                                                            tool_calls=calls or None),
                                finish_reason=_finish_reason(delta.finish_reason, bool(calls)))
            self._extras(body, choice, state, delta)
            choices.append(choice)
        return ChatCompletionResponse(
            id=request_id, created=created, model=body.model or self.model_name, choices=choices,
            usage=usage([prompt], sum(len(s.token_ids) for s in state.samples), state.num_cached_tokens),
            prompt_logprobs=(self.prompt_logprobs(state, body.prompt_logprobs, self.as_token_ids(body))
                             if body.prompt_logprobs is not None else None),
            prompt_token_ids=prompt.token_ids if body.return_token_ids else None,
            weight_version=state.weight_version)

    async def _events(self, body: ChatCompletionRequest, request_id: str, created: int,
                      prompt: Prompt, generation: Generation) -> AsyncIterator[str]:
        (state,) = generation.states
        version = max(self.engine.weight_version, state.weight_version)

        def chunk(choices: list[ChatChunkChoice], **extra: Any) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=body.model or self.model_name,
                                           choices=choices, weight_version=version, **extra))

        # The role comes first, in a chunk of its own, as OpenAI sends it.
        yield "".join(chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))],
                            prompt_token_ids=(prompt.token_ids if body.return_token_ids and index == 0
                                              else None))
                      for index in range(body.n))
        wants_tokens = body.logprobs or body.return_token_ids
        tools = [ChoiceToolCalls(body, self.options.tool_call_parser) for _ in range(body.n)]
        async for _ in generation.turns():
            version = max(version, state.weight_version)
            parts = []
            for delta in state.deltas():
                final = delta.finish_reason is not None
                content, calls = tools[delta.index].stream(delta.text, final)
                if not (content or calls or final or (delta.token_ids and wants_tokens)):
                    continue
                choice = ChatChunkChoice(
                    index=delta.index, delta=DeltaMessage(content=content or None, tool_calls=calls or None),
                    finish_reason=_finish_reason(delta.finish_reason, tools[delta.index].called))
                self._extras(body, choice, state, delta)
                parts.append(chunk([choice]))
            if parts:
                yield "".join(parts)
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=usage([prompt], sum(len(s.token_ids) for s in state.samples),
                                        state.num_cached_tokens))
