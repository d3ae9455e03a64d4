"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models,
/tokenize and /detokenize.

Each prompt becomes one engine request (all its n samples); the engine yields cumulative
outputs, and this module turns them into OpenAI bodies or into SSE chunks of deltas.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from rlserve.config import EngineConfig
from rlserve.engine.request import (CompletionOutput, InvalidRequestError, RequestOutput,
                                    SamplingParams, TokenLogprob)
from rlserve.server.metrics import RequestTimer, ServerMetrics
from rlserve.server.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice,
                                     ChatCompletionChunk, ChatCompletionRequest,
                                     ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                     CompletionChoice, CompletionLogprobs, CompletionRequest,
                                     CompletionResponse, DeltaMessage, DetokenizeRequest,
                                     DetokenizeResponse, ErrorResponse, ModelCard, ModelList,
                                     PromptTokensDetails, TokenizeChatRequest,
                                     TokenizeRequest, TokenizeResponse, TokenLogprobEntry,
                                     TopLogprob, Usage, WeightVersionSpan)

if TYPE_CHECKING:
    from rlserve.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

# Logprobs travel as JSON, which has no -inf; OpenAI-compatible servers use this floor.
LOGPROB_FLOOR = -9999.0


async def require_api_key(request: Request) -> None:
    key = request.app.state.api_key
    if not key:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       type="authentication_error", code="invalid_api_key")


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid parameters"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
}

router = APIRouter(dependencies=[Depends(require_api_key)], responses=ERRORS)


def _serving(request: Request) -> "OpenAIServing":
    return request.app.state.serving


# ---------------------------------------------------------------- routes


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> Response:
    return _json(_serving(request).models())


async def require_awake(request: Request) -> None:
    """With --reject-while-asleep, generation during /sleep is a 503 instead of a wait."""
    if request.app.state.reject_while_asleep and request.app.state.engine.is_sleeping:
        raise APIError(503, "the server is asleep (POST /wake_up first); it was started with "
                            "--reject-while-asleep", type="service_unavailable")


@router.post("/v1/completions", response_model=CompletionResponse, dependencies=[Depends(require_awake)],
             responses={200: {"content": {"text/event-stream": {}}}})
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    serving = _serving(request)
    return await _until_disconnect(request, serving.completion(body, time.monotonic()))


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             dependencies=[Depends(require_awake)], responses={200: {"content": {"text/event-stream": {}}}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    serving = _serving(request)
    return await _until_disconnect(request, serving.chat(body, time.monotonic()))


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest | TokenizeChatRequest, request: Request) -> Response:
    return _json(_serving(request).tokenize(body))


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    return _json(_serving(request).detokenize(body))


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`, cancelling it if the client goes away first.

    A streamed response notices a gone client when it writes; a request still being
    prepared (or a non-streamed one) would otherwise generate for nobody.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():  # the client left first; nobody reads this response
        _serving(request).metrics.disconnects.inc()
        return Response(status_code=499)
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------- engine streams


class _Streams:
    """Runs one engine stream per prompt and yields (prompt index, output) as they come.

    Closing it aborts every unfinished request: cancelling the pump task raises inside
    the engine's generator, which aborts the request and frees its KV blocks.
    """

    def __init__(self, streams: list[AsyncIterator[RequestOutput]], timers: list[RequestTimer]):
        self._streams = streams
        self._timers = timers
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = (
            asyncio.Queue())
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._open = len(streams)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._timers[i].observe(out)
                self._queue.put_nowait((i, out))
        except Exception as e:  # handed to the consumer; cancellation propagates
            self._queue.put_nowait((i, e))
        else:
            self._queue.put_nowait((i, None))

    async def _next(self) -> tuple[int, RequestOutput | None]:
        i, item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is None:
            self._open -= 1
        return i, item

    async def first(self) -> None:
        """Wait for every request's first output, so invalid requests fail before a
        stream's 200 is sent (the engine validates before it yields anything)."""
        waiting = set(range(len(self._streams)))
        while waiting:
            i, out = await self._next()
            waiting.discard(i)
            if out is not None:
                self._buffer.append((i, out))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        for item in self._buffer:
            yield item
        self._buffer.clear()
        while self._open:
            i, out = await self._next()
            if out is not None:
                yield i, out

    async def final(self) -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async for i, out in self:
            last[i] = out
        return [last[i] for i in range(len(self._streams))]

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self._streams:  # one whose task never ran was never started
            await s.aclose()  # type: ignore[attr-defined]


# ---------------------------------------------------------------- token strings


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte -> printable-character table of byte-level BPE (GPT-2)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenStrings:
    """Text and exact bytes of single tokens, for logprobs. A token that is half of a UTF-8
    character decodes to U+FFFD, but its bytes are still its own."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = _byte_decoder() if "ByteLevel" in repr(decoder) else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            hit = self._cache[token_id] = (text, self._bytes(token_id, text))
        return hit

    def text(self, token_id: int, as_id: bool = False) -> str:
        return f"token_id:{token_id}" if as_id else self.get(token_id)[0]

    def _bytes(self, token_id: int, text: str) -> list[int]:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level is not None and all(ch in self._byte_level for ch in piece):
                return [self._byte_level[ch] for ch in piece]
            m = _BYTE_PIECE.match(piece)
            if m:  # SentencePiece byte fallback
                return [int(m.group(1), 16)]
        return list(text.encode("utf-8"))


def _floor(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


# ---------------------------------------------------------------- serving


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str


@dataclass
class _Cursor:
    """What has been sent of one choice in a stream."""

    chars: int = 0
    tokens: int = 0
    text_offset: int = 0  # completions logprobs: offset of the next token in the choice text
    started: bool = False
    done: bool = False


@dataclass
class _Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    first: bool


def _finish_reason(c: CompletionOutput) -> str | None:
    return getattr(c.finish_reason, "value", c.finish_reason)


def _advance(cur: _Cursor, c: CompletionOutput) -> _Delta | None:
    if cur.done:
        return None
    reason = _finish_reason(c)
    delta = _Delta(text=c.text[cur.chars:], token_ids=c.token_ids[cur.tokens:],
                   logprobs=list((c.logprobs or [])[cur.tokens:]), finish_reason=reason,
                   first=not cur.started)
    cur.chars, cur.tokens = len(c.text), len(c.token_ids)
    cur.started, cur.done = True, reason is not None
    return delta


def _spans(c: CompletionOutput) -> list[WeightVersionSpan]:
    return [WeightVersionSpan(version=s.version, start=s.start, end=s.end)
            for s in c.weight_version_spans]


def _usage(prompts: Sequence[_Prompt], completion_tokens: int, cached: int) -> Usage:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise InvalidRequestError(f"{name}: not supported; leave it unset or 0", name)
    if body.logit_bias:
        raise InvalidRequestError("logit_bias: not supported", "logit_bias")


class OpenAIServing:
    """Request handling shared by the routes: validation, prompts, outputs to bodies."""

    def __init__(self, engine: "AsyncEngine", config: EngineConfig, metrics: ServerMetrics):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.tokens = TokenStrings(engine.tokenizer)
        self.created = int(time.time())
        self.vocab_size = int(getattr(engine, "vocab_size", None) or len(engine.tokenizer))

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    # ------------------------------------------------------------ checks and inputs

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model: {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        for t in ids:
            if t >= self.vocab_size:
                raise InvalidRequestError(
                    f"{param}: token id {t} is out of range; the vocabulary has "
                    f"{self.vocab_size} tokens", param)

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, ValueError) as e:  # e.g. lone surrogates the tokenizer refuses
            raise InvalidRequestError(f"{param}: cannot be tokenized ({e})", param) from e

    def _decode(self, ids: Sequence[int], param: str) -> str:
        self._check_ids(ids, param)
        try:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidRequestError(f"{param}: cannot be decoded ({e})", param) from e

    def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]],
                            ) -> list[_Prompt]:
        # One prompt (a string or a token-id list) or a batch of them; never empty.
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            items: list[str | list[int]] = [prompt]  # type: ignore[list-item]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = self._encode(item, True, "prompt")
                prompts.append(_Prompt(ids, item))
            else:
                prompts.append(_Prompt(list(item), self._decode(item, "prompt")))
            if not prompts[-1].token_ids:  # a string can tokenize to nothing
                raise InvalidRequestError("prompt: must not be empty", "prompt")
        return prompts

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool, kwargs: dict[str, Any] | None) -> str:
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message: cannot be combined with add_generation_prompt",
                "continue_final_message")
        template = self.config.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "messages: this model has no chat template; start the server with "
                "--chat-template", "messages")
        conversation = []
        for m in messages:
            content = m.content
            if isinstance(content, list):  # text parts only: the schema refuses others
                content = "".join(p.text for p in content)
            entry: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.name is not None:
                entry["name"] = m.name
            conversation.append(entry)
        try:
            return self.tokenizer.apply_chat_template(
                conversation, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(kwargs or {}))
        except Exception as e:  # template errors are caused by the messages sent
            raise InvalidRequestError(f"messages: the chat template failed: {e}",
                                      "messages") from e

    def _chat_prompt(self, body: ChatCompletionRequest | TokenizeChatRequest) -> _Prompt:
        text = self.render_chat(body.messages, body.add_generation_prompt,
                                body.continue_final_message, body.chat_template_kwargs)
        # The template already wrote the special tokens it wants.
        return _Prompt(self._encode(text, False, "messages"), text)

    def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest,
                         max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        limit = self.engine.max_model_len
        if max_tokens is not None and max_tokens > limit:
            param = "max_completion_tokens" if getattr(body, "max_completion_tokens",
                                                       None) else "max_tokens"
            raise InvalidRequestError(
                f"{param}: {max_tokens} is more than max_model_len ({limit})", param)
        top_k = body.top_k if body.top_k is not None else -1
        if top_k >= self.vocab_size:
            top_k = -1  # keeping every token is the same as no top-k
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
        )

    def _start(self, request_id: str, prompts: list[_Prompt], params: SamplingParams,
               arrival: float) -> _Streams:
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}"
                                                      for i in range(len(prompts))]
        streams = [self.engine.generate(p.token_ids, params, rid, prompt=p.text)
                   for p, rid in zip(prompts, ids)]
        timers = [self.metrics.timer(arrival) for _ in prompts]
        return _Streams(streams, timers)

    async def _respond(self, streams: _Streams, events: AsyncIterator[str] | None,
                       build: Callable[[list[RequestOutput]], BaseModel]) -> Response:
        """Stream `events` when given, else wait for the final outputs and `build` a body."""
        if events is None:
            try:
                return _json(build(await streams.final()))
            finally:
                await streams.aclose()
        try:
            await streams.first()
        except BaseException:
            await streams.aclose()
            raise
        return StreamingResponse(_closing(events, streams, self.metrics),
                                 media_type="text/event-stream")

    # ------------------------------------------------------------ /v1/completions

    async def completion(self, body: CompletionRequest, arrival: float) -> Response:
        self.check_model(body.model)
        _refuse_unsupported(body)
        if body.suffix:
            raise InvalidRequestError("suffix: not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequestError("best_of: only best_of == n is supported", "best_of")
        prompts = self._completion_prompts(body.prompt)
        k = body.logprobs
        params = self._sampling_params(body, body.max_tokens, k,
                                       prompt_logprobs=k if body.echo and k is not None else None)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = self._start(request_id, prompts, params, arrival)
        events = (self._completion_events(body, request_id, created, prompts, streams)
                  if body.stream else None)
        return await self._respond(
            streams, events,
            lambda outs: self._completion_body(body, request_id, created, prompts, outs))

    def _completion_logprobs(self, token_ids: Sequence[int],
                             logprobs: Sequence[TokenLogprob | None], k: int, offset: int,
                             as_ids: bool) -> tuple[CompletionLogprobs, int]:
        out = CompletionLogprobs()
        for tid, lp in zip(token_ids, logprobs):
            text = self.tokens.text(tid)
            out.tokens.append(self.tokens.text(tid, as_ids))
            out.text_offset.append(offset)
            offset += len(text)
            if lp is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            top = {self.tokens.text(t, as_ids): _floor(v) for t, v in lp.top[:k]}
            top.setdefault(self.tokens.text(tid, as_ids), _floor(lp.logprob))
            out.token_logprobs.append(_floor(lp.logprob))
            out.top_logprobs.append(top)
        return out, offset

    def _echo_logprobs(self, prompt: _Prompt, out: RequestOutput,
                       ) -> list[TokenLogprob | None]:
        lps = list(out.prompt_logprobs or [])
        return lps + [None] * (len(prompt.token_ids) - len(lps))

    def _completion_choice(self, body: CompletionRequest, index: int, prompt: _Prompt,
                           out: RequestOutput, c: CompletionOutput, delta: _Delta,
                           cur: _Cursor | None = None) -> CompletionChoice:
        """One choice of a body or a chunk: `delta` holds what is new in it."""
        echo = body.echo and delta.first
        text = (prompt.text if echo else "") + delta.text
        choice = CompletionChoice(index=index, text=text, finish_reason=delta.finish_reason)
        if body.logprobs is not None:
            ids: list[int] = list(delta.token_ids)
            lps: list[TokenLogprob | None] = list(delta.logprobs)
            if echo:
                ids = prompt.token_ids + ids
                lps = self._echo_logprobs(prompt, out) + lps
            choice.logprobs, offset = self._completion_logprobs(
                ids, lps, body.logprobs, cur.text_offset if cur else 0,
                body.return_tokens_as_token_ids)
            if cur:
                cur.text_offset = offset
        if body.return_token_ids:
            choice.token_ids = delta.token_ids
            if delta.first:
                choice.prompt_token_ids = prompt.token_ids
        if delta.finish_reason is not None:
            choice.stop_reason = c.stop_reason
            if body.return_weight_versions:
                choice.weight_version_spans = _spans(c)
        return choice

    def _completion_body(self, body: CompletionRequest, request_id: str, created: int,
                         prompts: list[_Prompt], outs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            for c in out.outputs:
                delta = _advance(_Cursor(), c)
                assert delta is not None
                choices.append(self._completion_choice(body, i * body.n + c.index, prompt,
                                                       out, c, delta))
        return CompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices,
            usage=_usage(prompts, sum(len(c.token_ids) for o in outs for c in o.outputs),
                         sum(o.num_cached_tokens for o in outs)),
            weight_version=max(o.weight_version for o in outs))

    async def _completion_events(self, body: CompletionRequest, request_id: str, created: int,
                                 prompts: list[_Prompt], streams: _Streams,
                                 ) -> AsyncIterator[str]:
        cursors: dict[int, _Cursor] = {}
        cached: dict[int, int] = {}
        version = self.engine.weight_version
        wants_tokens = body.logprobs is not None or body.return_token_ids
        async for i, out in streams:
            version, cached[i] = out.weight_version, out.num_cached_tokens
            for c in out.outputs:
                index = i * body.n + c.index
                cur = cursors.setdefault(index, _Cursor())
                delta = _advance(cur, c)
                if delta is None or not (delta.text or delta.finish_reason or delta.first
                                         or (delta.token_ids and wants_tokens)):
                    continue
                choice = self._completion_choice(body, index, prompts[i], out, c, delta, cur)
                yield _sse(CompletionResponse(id=request_id, created=created,
                                              model=self.model_name, choices=[choice],
                                              weight_version=version))
        if body.stream_options and body.stream_options.include_usage:
            usage = _usage(prompts, sum(c.tokens for c in cursors.values()),
                           sum(cached.values()))
            yield _sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                          choices=[], usage=usage, weight_version=version))

    # ------------------------------------------------------------ /v1/chat/completions

    async def chat(self, body: ChatCompletionRequest, arrival: float) -> Response:
        self.check_model(body.model)
        _refuse_unsupported(body)
        if body.tools:
            raise InvalidRequestError("tools: not supported", "tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise InvalidRequestError("response_format: only type 'text' is supported",
                                      "response_format")
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs set to true", "top_logprobs")
        prompt = self._chat_prompt(body)
        k = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = self._sampling_params(body, max_tokens, k)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = self._start(request_id, [prompt], params, arrival)
        events = (self._chat_events(body, request_id, created, prompt, streams)
                  if body.stream else None)
        return await self._respond(
            streams, events,
            lambda outs: self._chat_body(body, request_id, created, prompt, outs[0]))

    def _chat_logprobs(self, logprobs: Sequence[TokenLogprob], k: int,
                       as_ids: bool) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> TopLogprob:
            return TopLogprob(token=self.tokens.text(token_id, as_ids), logprob=_floor(logprob),
                              bytes=self.tokens.get(token_id)[1])

        content = []
        for lp in logprobs:
            e = entry(lp.token_id, lp.logprob)
            content.append(TokenLogprobEntry(
                token=e.token, logprob=e.logprob, bytes=e.bytes,
                top_logprobs=[entry(t, v) for t, v in lp.top[:k]]))
        return ChatLogprobs(content=content)

    def _chat_extras(self, body: ChatCompletionRequest, choice: ChatChoice | ChatChunkChoice,
                     c: CompletionOutput, delta: _Delta) -> None:
        if body.logprobs:
            choice.logprobs = self._chat_logprobs(delta.logprobs, body.top_logprobs or 0,
                                                  body.return_tokens_as_token_ids)
        if body.return_token_ids:
            choice.token_ids = delta.token_ids
        if delta.finish_reason is not None:
            choice.stop_reason = c.stop_reason
            if body.return_weight_versions:
                choice.weight_version_spans = _spans(c)

    def _chat_body(self, body: ChatCompletionRequest, request_id: str, created: int,
                   prompt: _Prompt, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in out.outputs:
            delta = _advance(_Cursor(), c)
            assert delta is not None
            choice = ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                                finish_reason=delta.finish_reason)
            self._chat_extras(body, choice, c, delta)
            choices.append(choice)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices,
            usage=_usage([prompt], sum(len(c.token_ids) for c in out.outputs),
                         out.num_cached_tokens),
            prompt_token_ids=prompt.token_ids if body.return_token_ids else None,
            weight_version=out.weight_version)

    async def _chat_events(self, body: ChatCompletionRequest, request_id: str, created: int,
                           prompt: _Prompt, streams: _Streams) -> AsyncIterator[str]:
        version = self.engine.weight_version

        def chunk(choices: list[ChatChunkChoice], **extra: Any) -> str:
            return _sse(ChatCompletionChunk(id=request_id, created=created,
                                            model=self.model_name, choices=choices,
                                            weight_version=version, **extra))

        # The role comes first, in a chunk of its own, as OpenAI sends it.
        for index in range(body.n):
            yield chunk([ChatChunkChoice(index=index,
                                         delta=DeltaMessage(role="assistant", content=""))],
                        prompt_token_ids=(prompt.token_ids if body.return_token_ids and index == 0
                                          else None))
        cursors = [_Cursor() for _ in range(body.n)]
        cached = 0
        wants_tokens = body.logprobs or body.return_token_ids
        async for _, out in streams:
            version, cached = out.weight_version, out.num_cached_tokens
            for c in out.outputs:
                delta = _advance(cursors[c.index], c)
                if delta is None or not (delta.text or delta.finish_reason
                                         or (delta.token_ids and wants_tokens)):
                    continue
                choice = ChatChunkChoice(index=c.index,
                                         delta=DeltaMessage(content=delta.text or None),
                                         finish_reason=delta.finish_reason)
                self._chat_extras(body, choice, c, delta)
                yield chunk([choice])
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=_usage([prompt], sum(c.tokens for c in cursors), cached))

    # ------------------------------------------------------------ the rest

    def models(self) -> ModelList:
        # `root` is the served name too: the directory the weights came from is nobody's business.
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         root=self.model_name,
                                         max_model_len=self.engine.max_model_len)])

    def tokenize(self, body: TokenizeRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = self._chat_prompt(body).token_ids
        else:
            ids = self._encode(body.prompt, body.add_special_tokens, "prompt")
        strs = ([self.tokenizer.convert_ids_to_tokens(t) for t in ids]
                if body.return_token_strs else None)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len,
                                tokens=ids, token_strs=strs)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        return DetokenizeResponse(prompt=self._decode(body.tokens, "tokens"))


async def _closing(events: AsyncIterator[str] | None, streams: _Streams,
                   metrics: ServerMetrics) -> AsyncIterator[str]:
    """SSE body: the events, then [DONE]; whatever happens, the engine requests end."""
    assert events is not None
    ended = False
    try:
        try:
            async for event in events:
                yield event
        except Exception as e:  # the 200 is already sent: report in-band, as OpenAI does
            logger.exception("stream failed")
            if isinstance(e, InvalidRequestError):
                err = APIError(400, str(e), param=e.param, code=400)
            else:
                err = APIError(500, f"internal error: {e}", type="server_error", code=500)
            yield _sse(err.body)
        ended = True
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            metrics.disconnects.inc()
        # A gone client cancels this generator; a shielded scope lets the aborts complete.
        with anyio.CancelScope(shield=True):
            await events.aclose()  # type: ignore[attr-defined]
            await streams.aclose()
