"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, and vLLM's
/v1/chat/completions/batch, /invocations (SageMaker's), /tokenize and /detokenize. The
serving_* modules do the work."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, TypeAdapter, ValidationError

from rlserve.sampling_params import InvalidRequestError
from rlserve.server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from rlserve.server.responses import (
    APIError,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from rlserve.server.serving import json_response


async def require_api_key(request: Request) -> None:
    key = request.app.state.api_key
    if not key:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       type="authentication_error", code="invalid_api_key")


async def require_awake(request: Request) -> None:
    """With --reject-while-asleep, generation during /sleep is a 503 instead of a wait."""
    if request.app.state.reject_while_asleep and (await request.app.state.engine.stats()).sleeping:
        # The server's own refusal (an APIError): counted below as an admission rejection.
        raise APIError(503, "the server is asleep (POST /wake_up first); it was started with "
                            "--reject-while-asleep")


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid parameters"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
}

router = APIRouter(dependencies=[Depends(require_api_key)], responses=ERRORS)

# Bodies the routes parse themselves: the app's schema publishes them as components.
BODY_MODELS: list[type[BaseModel]] = []


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses `model` itself."""
    BODY_MODELS.append(model)
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> Response:
    from rlserve.server.routes_lora import lora_model_cards
    serving = request.app.state.completions
    return json_response(ModelList(data=[ModelCard(
        id=serving.model_name, created=serving.created, root=serving.model_name,
        max_model_len=serving.engine.max_model_len), *await lora_model_cards(request)]))


# The generation routes parse their own bodies (pydantic straight from the bytes) and check
# access inline: FastAPI's body and dependency solving cost more than the rest of admitting a
# request, and a rollout burst is admitted by one event loop. The schema still names the body.
generation = APIRouter(responses=ERRORS)


@generation.post("/v1/completions", response_model=CompletionResponse,
                 openapi_extra=json_body(CompletionRequest),
                 responses={200: {"content": {"text/event-stream": {}}}})
async def create_completion(request: Request) -> Response:
    return await _generate(request, CompletionRequest, request.app.state.completions)


@generation.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                 openapi_extra=json_body(ChatCompletionRequest),
                 responses={200: {"content": {"text/event-stream": {}}}})
async def create_chat_completion(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest, request.app.state.chat)


@generation.post("/v1/chat/completions/batch", response_model=ChatCompletionResponse,
                 openapi_extra=json_body(BatchChatCompletionRequest))
async def create_batch_chat_completion(request: Request) -> Response:
    return await _generate(request, BatchChatCompletionRequest, request.app.state.chat)


_BODY_OBJECT = TypeAdapter(dict[str, Any])


@generation.post("/invocations", response_model=ChatCompletionResponse | CompletionResponse,
                 responses={200: {"content": {"text/event-stream": {}}}})
async def invocations(request: Request) -> Response:
    """SageMaker's one route, as vLLM serves it: a body with `messages` is a chat
    completion, one with `prompt` a completion. Dispatched on that key rather than on
    which schema validates (vLLM's way), so a bad field gets its own 400, not a guess."""
    await require_api_key(request)
    try:
        keys = _BODY_OBJECT.validate_json(await request.body()).keys()
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None
    if "messages" in keys:
        return await _generate(request, ChatCompletionRequest, request.app.state.chat)
    if "prompt" in keys:
        return await _generate(request, CompletionRequest, request.app.state.completions)
    raise APIError(400, "Cannot find suitable handler for request. Expected one of: "
                        "['ChatCompletionRequest', 'CompletionRequest'] (a body with `messages` "
                        "or with `prompt`)", param="body")


async def _generate(request: Request, model: type[BaseModel], serving) -> Response:
    """The checks the other routes get as dependencies, the body validated as `model`, then
    `serving` answers it (cancelled if the client leaves first)."""
    arrival = time.monotonic()
    await require_api_key(request)
    try:
        await require_awake(request)
        try:
            body = model.model_validate_json(await request.body())
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None
        return await _until_disconnect(request, serving.create(body, arrival))
    except (APIError, InvalidRequestError, RequestValidationError):
        request.app.state.metrics.admission_rejections += 1
        raise


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest | TokenizeChatRequest, request: Request) -> Response:
    serving = request.app.state.chat
    serving.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        ids = (await serving.prompts.chat_prompt_async(body)).token_ids
    else:
        ids = await serving.prompts.encode_async(body.prompt, body.add_special_tokens, "prompt")
    strs = [serving.tokenizer.convert_ids_to_tokens(t) for t in ids] if body.return_token_strs else None
    return json_response(TokenizeResponse(count=len(ids), max_model_len=serving.engine.max_model_len,
                                          tokens=ids, token_strs=strs))


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    serving = request.app.state.chat
    serving.check_model(body.model)
    return json_response(DetokenizeResponse(prompt=serving.prompts.decode(body.tokens, "tokens")))


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
        request.app.state.metrics.client_left()
        return Response(status_code=499)
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
