"""/v1/completions: prompts (text or token ids, one or a batch) -> choices, whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi.responses import Response

from rlserve.frontend.output_processor import RequestState, SampleDelta
from rlserve.sampling_params import InvalidRequestError
from rlserve.sequence import TokenLogprob
from rlserve.server.generation import Generation
from rlserve.server.prompts import Prompt
from rlserve.server.protocol import CompletionRequest
from rlserve.server.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from rlserve.server.serving import OpenAIServing, finish_choice, sse, usage, usage_so_far
from rlserve.server.token_strings import floor_logprob


class CompletionServing(OpenAIServing):
    async def create(self, body: CompletionRequest, arrival: float) -> Response:
        lora_name = self.check_model(body.model)
        self.check_request(body)
        if body.suffix:
            raise InvalidRequestError("suffix: not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequestError("best_of: only best_of == n is supported", "best_of")
        prompts = await self._prompts(body)
        k = body.logprobs
        # Echoed logprobs cover the prompt too: the engine computes the larger top-k. A
        # stream never carries prompt_logprobs (0 is accepted there, as in vLLM).
        wanted = [x for x in (None if body.stream else body.prompt_logprobs, k if body.echo else None)
                  if x is not None]
        params = self.sampling_params(body, body.max_tokens, k,
                                      prompt_logprobs=max(wanted) if wanted else None)
        engine_id = f"cmpl-{uuid.uuid4().hex}"
        request_id = f"cmpl-{body.request_id}" if body.request_id else engine_id
        created = int(time.time())
        generation = Generation(self.engine, engine_id, prompts, params, arrival, body.stream,
                                body.cache_salt, lora_name, self.metrics)
        events = (self._events(body, request_id, created, prompts, generation) if body.stream else None)
        return await self.respond(generation, events,
                                  lambda: self._body(body, request_id, created, prompts, generation), body)

    async def _prompts(self, body: CompletionRequest) -> list[Prompt]:
        """One prompt (a string or a token-id list) or a batch of them; never empty. Token
        prompts are decoded for `echo` unless the request skips detokenization."""
        prompt, detokenize, add_special_tokens = body.prompt, body.detokenize, body.add_special_tokens
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            items: list[str | list[int]] = [prompt]
        else:
            items = list(prompt)
        if len(items) > self.max_prompts:
            raise InvalidRequestError(f"prompt: {len(items)} prompts in one request, the limit is "
                                      f"{self.max_prompts} (--max-prompts-per-request)", "prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(Prompt(await self.prompts.encode_async(item, add_special_tokens, "prompt"), item))
            elif detokenize:
                prompts.append(Prompt(list(item), self.prompts.decode(item, "prompt")))
            else:
                self.prompts.check_ids(item, "prompt")
                prompts.append(Prompt(list(item), ""))
            prompts[-1] = self.truncate(prompts[-1], body)
            if not prompts[-1].token_ids:  # a string can tokenize to nothing
                raise InvalidRequestError("prompt: must not be empty", "prompt")
        return prompts

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], k: int,
                  offset: int, as_ids: bool, text_offsets: bool) -> tuple[CompletionLogprobs, int]:
        """`text_offsets`: where each token starts in the choice's text (0 without text)."""
        out = CompletionLogprobs()
        for tid, lp in zip(token_ids, logprobs):
            out.tokens.append(self.tokens.text(tid, as_ids))
            out.text_offset.append(offset)
            if text_offsets:
                offset += len(self.tokens.text(tid))
            if lp is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            # The chosen token first, then the k most likely (vLLM's order).
            top = {self.tokens.text(tid, as_ids): floor_logprob(lp.logprob)}
            for t, v in lp.top.head(k):
                top.setdefault(self.tokens.text(t, as_ids), floor_logprob(v))
            out.token_logprobs.append(floor_logprob(lp.logprob))
            out.top_logprobs.append(top)
        return out, offset

    def _choice(self, body: CompletionRequest, index: int, prompt: Prompt, state: RequestState,
                delta: SampleDelta, offsets: dict[int, int] | None = None) -> CompletionStreamChoice:
        """One choice of a body or (`offsets` given) a chunk: `delta` holds what is new in it."""
        echo = body.echo and delta.first
        text = (prompt.text if echo else "") + delta.text
        cls = CompletionStreamChoice if offsets is not None else CompletionChoice
        # The engine's reasons are stop, length and abort, typed there as str.
        choice = cls(index=index, text=text, finish_reason=delta.finish_reason)  # type: ignore[arg-type]
        if body.logprobs is not None:
            ids: list[int] = list(delta.token_ids)
            lps: list[TokenLogprob | None] = list(delta.logprobs or [])
            if echo:
                ids = prompt.token_ids + ids
                prompt_lps = list(state.prompt_logprobs or [])
                lps = prompt_lps + [None] * (len(prompt.token_ids) - len(prompt_lps)) + lps
            as_ids = self.as_token_ids(body)
            k = -1 if body.logprob_token_ids else body.logprobs  # the chosen ones, all of them
            choice.logprobs, offset = self._logprobs(ids, lps, k,
                                                     offsets.get(index, 0) if offsets else 0, as_ids,
                                                     body.detokenize)
            if offsets is not None:
                offsets[index] = offset
        if body.return_token_ids:
            choice.token_ids = delta.token_ids
            if delta.first:
                choice.prompt_token_ids = prompt.token_ids
        if body.prompt_logprobs is not None and delta.first and isinstance(choice, CompletionChoice):
            choice.prompt_logprobs = self.prompt_logprobs(state, body.prompt_logprobs,
                                                          self.as_token_ids(body))
        if delta.finish_reason is not None:
            finish_choice(choice, body, state, delta)
        return choice

    def _body(self, body: CompletionRequest, request_id: str, created: int, prompts: list[Prompt],
              generation: Generation) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        for i, (prompt, state) in enumerate(zip(prompts, generation.states)):
            for delta in state.deltas():
                choice = self._choice(body, i * body.n + delta.index, prompt, state, delta)
                assert isinstance(choice, CompletionChoice)  # no offsets: a body's choice
                choices.append(choice)
        states = generation.states
        return CompletionResponse(
            id=request_id, created=created, model=body.model or self.model_name, choices=choices,
            usage=usage(prompts, sum(len(s.token_ids) for st in states for s in st.samples),
                        sum(st.num_cached_tokens for st in states)),
            weight_version=max(st.weight_version for st in states))

    async def _events(self, body: CompletionRequest, request_id: str, created: int,
                      prompts: list[Prompt], generation: Generation) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        wants_tokens = body.logprobs is not None or body.return_token_ids
        version = self.engine.weight_version
        final_usage, running_usage = self.usage_wanted(body)
        async for _ in generation.turns():
            parts = []
            for i, state in enumerate(generation.states):
                version = max(version, state.weight_version)
                for delta in state.deltas():
                    if not (delta.text or delta.finish_reason or delta.first
                            or (delta.token_ids and wants_tokens)):
                        continue
                    choice = self._choice(body, i * body.n + delta.index, prompts[i], state, delta, offsets)
                    parts.append(sse(CompletionStreamResponse(
                        id=request_id, created=created, model=body.model or self.model_name, choices=[choice],
                        weight_version=version,
                        usage=usage_so_far(prompts[i], state, delta.index) if running_usage else None)))
            if parts:
                yield "".join(parts)
        if final_usage:
            states = generation.states
            u = usage(prompts, sum(len(s.token_ids) for st in states for s in st.samples),
                      sum(st.num_cached_tokens for st in states))
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=body.model or self.model_name,
                                               choices=[], usage=u, weight_version=version))
