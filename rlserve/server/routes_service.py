"""vLLM's service endpoints beyond health and metrics: GET /load (requests in flight, with
--enable-server-load-tracking; 0 without), GET /tokenizer_info (with
--enable-tokenizer-info-endpoint), and POST /collective_rpc's answer."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from rlserve.server.responses import APIError
from rlserve.server.routes_openai import require_api_key

# The endpoints that put work on the engine, as vLLM counts them for /load.
_LOADED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch",
                           "/invocations"})


class ServerLoad:
    """ASGI middleware: how many generation requests are in flight, a stream counted until
    its last byte is sent (what a load balancer in front of several servers reads)."""

    def __init__(self, app: ASGIApp, counter: dict[str, int]):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].removeprefix(scope.get("root_path", "")) not in _LOADED_PATHS:
            await self.app(scope, receive, send)
            return
        self.counter["in_flight"] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter["in_flight"] -= 1


def add_service_routes(app: FastAPI, load_tracking: bool, tokenizer_info: bool) -> None:
    counter = {"in_flight": 0}
    if load_tracking:
        app.add_middleware(ServerLoad, counter=counter)
    router = APIRouter(dependencies=[Depends(require_api_key)], tags=["service"])

    @router.get("/load")
    async def load() -> JSONResponse:
        return JSONResponse({"server_load": counter["in_flight"]})

    if tokenizer_info:
        @router.get("/tokenizer_info")
        async def get_tokenizer_info(request: Request) -> JSONResponse:
            return JSONResponse(_tokenizer_info(request.app.state.engine))

    # Out of the OpenAPI schema: it only says what to use instead (a deliberate 501, which the
    # schema fuzz, where any 5xx is a bug, would flag).
    @router.post("/collective_rpc", include_in_schema=False)
    async def collective_rpc() -> JSONResponse:
        raise APIError(501, "collective_rpc: rlserve runs no worker extensions, so there is no "
                            "method to call on the workers; use the weight-update endpoints "
                            "(/init_weight_transfer_engine, /start_weight_update, /update_weights, "
                            "/finish_weight_update), /weight_info and /pause, /resume, /sleep, "
                            "/wake_up instead", param="method")

    app.include_router(router)


def _tokenizer_info(engine: Any) -> dict[str, Any]:
    """vLLM's answer: the tokenizer's class and its configuration, the chat template included."""
    tok = engine.tokenizer
    if tok is None:
        raise APIError(404, "the server runs with --skip-tokenizer-init: there is no tokenizer")
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    for key in ("model_max_length", "padding_side", "truncation_side", "clean_up_tokenization_spaces",
                "bos_token", "eos_token", "unk_token", "pad_token", "chat_template"):
        value = getattr(tok, key, None)
        if isinstance(value, (str, int, float, bool)):
            info[key] = value
    info["vocab_size"] = len(tok)
    info["added_tokens_decoder"] = {str(i): {"content": t.content, "special": t.special}
                                    for i, t in tok.added_tokens_decoder.items()}
    return info
