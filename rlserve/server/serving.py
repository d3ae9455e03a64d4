"""What completions and chat completions share: the request's checks, its sampling
parameters, and the parts of the answer both build (usage, a choice's ending, prompt
logprobs, the JSON body or the SSE stream). Prompts are prompts.py's; the engine requests
behind one HTTP request, generation.py's `Generation`."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from rlserve.config import EngineConfig
from rlserve.engine.structured_output import StructuredOutputCompiler
from rlserve.errors import ModelNotFoundError, StatusError
from rlserve.frontend.bad_words import convert_bad_words
from rlserve.frontend.output_processor import RequestState, SampleDelta
from rlserve.sampling_params import InvalidRequestError, SamplingParams, check_logprobs_limit
from rlserve.server.generation import Generation
from rlserve.server.metrics import ServerMetrics
from rlserve.server.options import ServeOptions
from rlserve.server.prompts import Prompt, PromptRenderer
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.responses import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    CompletionStreamChoice,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    Usage,
    WeightVersionSpan,
)
from rlserve.server.routes_json import RoutesJSON, splice
from rlserve.server.structured import as_user_field, constraint
from rlserve.server.token_strings import TokenStrings, floor_logprob
from rlserve.wire.outputs import version_spans

if TYPE_CHECKING:
    from rlserve.frontend.async_engine import AsyncEngine


def json_response(model: BaseModel) -> Response:
    return Response(splice(model.model_dump_json()), media_type="application/json")


def sse(model: BaseModel, exclude_unset: bool = False) -> str:
    """One server-sent event. `exclude_unset`: only the fields set (vLLM's chat chunks)."""
    return f"data: {splice(model.model_dump_json(exclude_unset=exclude_unset))}\n\n"


def usage(prompts: Sequence[Prompt], completion_tokens: int, cached: int) -> Usage:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def usage_so_far(prompt: Prompt, state: RequestState, index: int) -> Usage:
    """A streamed choice's usage up to its latest chunk (continuous_usage_stats)."""
    return usage([prompt], len(state.samples[index].token_ids), state.num_cached_tokens)


def finish_choice(choice: CompletionStreamChoice | ChatChoice | ChatChunkChoice,
                  body: CompletionRequest | ChatCompletionRequest, state: RequestState, delta: SampleDelta) -> None:
    """What a choice's last body or chunk adds: its stop reason, its routed experts when the
    engine records them, and, when asked for, which weights made which tokens, as vLLM's
    `weight_versions` (the version as the string /weight_info reports) and rlserve's older
    `weight_version_spans` (an integer)."""
    choice.stop_reason = delta.stop_reason
    routes = state.samples[delta.index].routed_experts
    if routes is not None:
        choice.routed_experts = RoutesJSON(routes)
    if body.return_weight_versions:
        spans = version_spans(state.samples[delta.index].token_versions)
        labels = state.weight_labels  # a version /finish_weight_update labelled reports its label
        choice.weight_versions = [WeightVersionSpan(version=labels.get(s.version, str(s.version)), start=s.start,
                                                    end=s.end) for s in spans]
        choice.weight_version_spans = [WeightVersionSpan(version=s.version, start=s.start, end=s.end)
                                       for s in spans]


class OpenAIServing:
    """Request handling shared by the routes: validation, prompts, sampling parameters."""

    def __init__(self, engine: AsyncEngine, config: EngineConfig, metrics: ServerMetrics,
                 options: ServeOptions | None = None):
        self.options = options or ServeOptions()
        self.max_prompts = self.options.max_prompts_per_request
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.tokens = TokenStrings(engine.tokenizer)
        self.prompts = PromptRenderer(engine.tokenizer, engine.vocab_size, config.chat_template)
        self.created = int(time.time())
        self.vocab_size = engine.vocab_size
        assert engine.info is not None  # built at start-up, once the engine has started
        # Only its `validate` runs here (a spec's parse); the engine compiles the masks.
        self.grammars = StructuredOutputCompiler(engine.tokenizer, engine.vocab_size,
                                                 engine.info.eos_token_ids, limits=config.grammar_limits)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def model_dir_name(self) -> str | None:
        """A model served under its path (no --served-model-name) also answers to its
        directory's name, as a client written against the short name expects."""
        if self.config.served_model_name:
            return None
        return os.path.basename(os.path.normpath(self.model_name)) or None

    # ------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model). With --enable-lora any
        other name goes to the engine, which knows the adapters loaded (404 if not)."""
        if model is None or model == self.model_name or model == self.model_dir_name:
            return None
        if self.config.enable_lora:
            return model
        raise ModelNotFoundError(f"model: {model!r} does not exist; this server serves {self.model_name!r}")

    def check_request(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """What the schema cannot say about a request on its own."""
        if body.stop and not body.detokenize:
            raise InvalidRequestError("stop: stop strings need detokenize (leave it true, or use "
                                      "stop_token_ids)", "stop")
        if body.stream_options is not None and body.stream_options.model_fields_set and not body.stream:
            raise InvalidRequestError("stream_options: stream options can only be defined when "
                                      "`stream=True` (as in vLLM)", "stream_options")
        if body.logprob_token_ids is not None and (body.logprobs is None or body.logprobs is False):
            raise InvalidRequestError("logprob_token_ids: needs logprobs (the top-k it replaces) set",
                                      "logprob_token_ids")
        if body.logprob_token_ids is not None:
            self.prompts.check_ids(body.logprob_token_ids, "logprob_token_ids")
        if body.prompt_logprobs and body.stream:
            raise InvalidRequestError("prompt_logprobs: not available with stream (as in vLLM); "
                                      "send the request without stream", "prompt_logprobs")
        # vLLM names `logprobs` for chat's top_logprobs too: both are the sampled tokens'.
        for name, param in (("logprobs", "logprobs"), ("top_logprobs", "logprobs"),
                            ("prompt_logprobs", "prompt_logprobs")):
            value = getattr(body, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                check_logprobs_limit(name if name == param else f"{param}: {name}", value,
                                     self.engine.max_logprobs, self.vocab_size, param)

    def usage_wanted(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
        """(a stream ends with a usage chunk, each chunk carries the usage so far): vLLM's
        stream_options.include_usage (or --enable-force-include-usage), and with it
        stream_options.continuous_usage_stats."""
        opts = body.stream_options
        final = self.options.enable_force_include_usage or bool(opts and opts.include_usage)
        return final, final and bool(opts and opts.continuous_usage_stats)

    def truncate(self, prompt: Prompt, body: CompletionRequest | ChatCompletionRequest) -> Prompt:
        """The prompt's last truncate_prompt_tokens tokens (vLLM's left truncation)."""
        keep = body.truncate_prompt_tokens
        if keep is None:
            return prompt
        limit = self.engine.max_model_len
        if keep == 0 or keep > limit:
            raise InvalidRequestError(f"truncate_prompt_tokens: {keep}: must be -1 (max_model_len) or "
                                      f"1 to max_model_len ({limit})", "truncate_prompt_tokens")
        keep = limit if keep == -1 else keep
        if len(prompt.token_ids) <= keep:
            return prompt
        ids = prompt.token_ids[-keep:]
        return Prompt(ids, self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else "")

    def as_token_ids(self, body: CompletionRequest | ChatCompletionRequest) -> bool:
        """Whether logprob tokens are written 'token_id:<id>'."""
        wanted = body.return_tokens_as_token_ids
        if wanted is None:
            wanted = self.options.return_tokens_as_token_ids
        return wanted or not body.detokenize

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest,
                        max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters: the request's fields, else the generation config's
        defaults (--generation-config), else OpenAI's and vLLM's."""
        limit = self.engine.max_model_len
        if max_tokens is not None and max_tokens > limit:
            param = "max_completion_tokens" if getattr(body, "max_completion_tokens",
                                                       None) else "max_tokens"
            raise InvalidRequestError(
                f"{param}: {max_tokens} is more than max_model_len ({limit})", param)
        defaults = self.options.generation_defaults
        cap = defaults.get("max_tokens")  # a server-wide limit, as in vLLM
        if cap is not None:
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)

        def pick(name: str, neutral: Any) -> Any:
            value = getattr(body, name)
            return value if value is not None else defaults.get(name, neutral)

        top_k = pick("top_k", -1)
        if top_k >= self.vocab_size:
            top_k = -1  # keeping every token is the same as no top-k
        structured = constraint(body, self.grammars)
        params = SamplingParams(
            n=body.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=top_k,
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            # SamplingParams takes JSON's string keys and turns them into token ids.
            logit_bias=body.logit_bias,  # type: ignore[arg-type]
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            structured_outputs=structured.spec if structured is not None else None,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop,  # type: ignore[arg-type]  # a single string too: SamplingParams makes it a list
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            logprob_token_ids=body.logprob_token_ids,
            prompt_logprobs=prompt_logprobs,
            detokenize=body.detokenize,
            skip_special_tokens=body.skip_special_tokens,
            return_routed_experts=body.return_routed_experts,
        )
        return convert_bad_words(params, self.tokenizer)

    def prompt_logprobs(self, state: RequestState, k: int, as_ids: bool) -> PromptLogprobs:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else the token and
        the k most likely ones at its position, keyed by token id."""
        out: PromptLogprobs = []
        logprobs = state.prompt_logprobs or []
        for i in range(len(state.prompt_token_ids)):
            lp = logprobs[i] if i < len(logprobs) else None
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): PromptLogprob(
                logprob=floor_logprob(lp.logprob), rank=lp.rank,
                decoded_token=self.tokens.text(lp.token_id, as_ids))}
            for rank, (t, v) in enumerate(lp.top.head(k), 1):
                entry.setdefault(str(t), PromptLogprob(logprob=floor_logprob(v), rank=rank,
                                                       decoded_token=self.tokens.text(t, as_ids)))
            out.append(entry)
        return out

    # ------------------------------------------------------------ responses

    async def respond(self, generation: Generation, events: AsyncIterator[str] | None,
                      build, body: CompletionRequest | ChatCompletionRequest) -> Response:
        """Stream `events` when given, else wait for the end and `build` the body. The
        engine's refusal of `body`'s grammar names the field the user sent."""
        try:
            if events is None:
                try:
                    await generation.until_finished()
                    return json_response(build())
                finally:
                    generation.close()
            try:
                await generation.until_started()
            except BaseException:
                generation.close()
                raise
        except InvalidRequestError as e:
            raise as_user_field(body, e) from None
        return StreamingResponse(self._closing(events, generation), media_type="text/event-stream")

    async def _closing(self, events: AsyncIterator[str], generation: Generation) -> AsyncIterator[str]:
        """SSE body: the events, then [DONE]; whatever happens, the engine requests end."""
        import logging

        import anyio
        ended = False
        try:
            try:
                async for event in events:
                    yield event
            except Exception as e:  # the 200 is already sent: report in-band, as OpenAI does
                if isinstance(e, StatusError):
                    err = APIError.of(e)
                else:
                    logging.getLogger(__name__).exception("stream failed")
                    err = APIError(500, f"internal error: {e}")
                yield sse(err.body)
            ended = True
            yield "data: [DONE]\n\n"
        finally:
            if not ended:
                self.metrics.client_left()
            # A gone client cancels this generator; a shielded scope lets the aborts complete.
            with anyio.CancelScope(shield=True):
                await events.aclose()  # type: ignore[attr-defined]
                generation.close()
