"""The FastAPI application: routes, OpenAI-shaped errors, health and metrics."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from rlserve import envs
from rlserve.config import EngineConfig
from rlserve.errors import StatusError
from rlserve.process import profiled
from rlserve.server import routes_openai
from rlserve.server.limits import BODY_JSON_DEPTH, BodySizeLimit
from rlserve.server.metrics import CONTENT_TYPE, ServerMetrics
from rlserve.server.options import ServeOptions
from rlserve.server.responses import APIError, VersionResponse, error_type
from rlserve.server.routes_service import add_service_routes
from rlserve.server.serving_chat import ChatServing
from rlserve.server.serving_completion import CompletionServing
from rlserve.version import __version__

if TYPE_CHECKING:
    from rlserve.frontend.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

def create_app(engine: AsyncEngine, config: EngineConfig, opts: ServeOptions | None = None, *,
               url: str | None = None) -> FastAPI:
    """Build the app around an engine whose process is starting: the app's start-up waits
    until the model has loaded, and its shutdown stops the engine. `opts`: the server's
    flags (keys, limits, sampling defaults), as `rlserve serve` parsed them."""
    opts = opts or ServeOptions()
    metrics = ServerMetrics(config.name, config=config)
    lifespan = _lifespan(engine, config, metrics, opts, url)
    app = FastAPI(title="rlserve", version=__version__, lifespan=lifespan, root_path=opts.root_path,
                  description="OpenAI-compatible rollout server for RL post-training.")
    app.state.engine = engine
    app.state.config = config
    app.state.api_key = opts.api_key
    app.state.admin_key = opts.admin_key
    app.state.allow_remote_control = opts.allow_remote_control  # see rlserve/server/security.py
    app.state.reject_while_asleep = opts.reject_while_asleep
    app.state.metrics = metrics
    app.state.stopping = asyncio.Event()  # set on SIGINT/SIGTERM: pending control calls end

    app.add_middleware(BodySizeLimit, max_bytes=opts.max_request_body_bytes)
    _add_error_handlers(app)
    _add_service_routes(app)
    add_service_routes(app, opts.enable_server_load_tracking, opts.enable_tokenizer_info_endpoint)
    _add_routers(app, engine, config, opts.enable_sleep_mode)
    return app


def _lifespan(engine: AsyncEngine, config: EngineConfig, metrics: ServerMetrics, opts: ServeOptions,
              url: str | None):
    """Start-up: wait for the engine's model, then set up the two serving flows; shutdown:
    stop the engine."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        info = await engine.start()
        logger.info("loaded %r (%s on %s, %s) in %.1fs: max_model_len %d, KV cache %d tokens, "
                    "weight version %d", engine.model_name, info.model_type, info.device, info.dtype,
                    info.load_seconds, info.max_model_len, info.kv_capacity_tokens, info.weight_version)
        engine.set_latency_observer(metrics)
        metrics.memory = info.memory
        metrics.set_max_model_len(engine.max_model_len)
        app.state.completions = CompletionServing(engine, config, metrics, opts)
        app.state.chat = ChatServing(engine, config, metrics, opts)
        _limit_max_tokens_in_schema(app, engine.max_model_len)
        # Everything start-up made (tokenizer, templates, routes, schemas) lives as long as
        # the server: out of the collector's sight, a request's garbage is cheap to collect.
        gc.collect()
        gc.freeze()
        if url:
            logger.info("serving %r at %s (OpenAI base URL %s/v1)", engine.model_name, url, url)
        # RLSERVE_API_PROFILE=PATH: a cProfile of this API server's event loop, written at
        # exit to PATH.<pid>.
        path = envs.RLSERVE_API_PROFILE.get()
        try:
            with profiled(f"{path}.{os.getpid()}" if path else None):
                yield
        finally:
            await engine.shutdown()
            gc.unfreeze()  # what start-up froze can be collected again (an app in a longer-lived process)

    return lifespan


def _add_routers(app: FastAPI, engine: AsyncEngine, config: EngineConfig, enable_sleep_mode: bool) -> None:
    """The OpenAI routes, and those of the features this server runs with."""
    app.include_router(routes_openai.router)
    app.include_router(routes_openai.generation)
    if config.data_parallel_size > 1:
        from rlserve.server.routes_replicas import router as replicas_router
        app.include_router(replicas_router)
    if config.enable_lora:
        from rlserve.server.routes_lora import add_lora_routes
        add_lora_routes(app)
    if config.weight_transfer is not None:
        # The control plane exists only when a weight-transfer backend is configured.
        from rlserve.server.routes_control import add_control_routes
        add_control_routes(app)
    elif enable_sleep_mode:
        from rlserve.server.routes_control import add_sleep_routes
        add_sleep_routes(app)


def _add_service_routes(app: FastAPI) -> None:
    # /ping is SageMaker's health check (vLLM serves it with /invocations).
    @app.api_route("/ping", methods=["GET", "POST"], tags=["service"], response_class=Response)
    @app.get("/health", tags=["service"], response_class=Response)
    async def health() -> Response:
        # Down once the engine loop died, or (even while idle) a tensor-parallel worker did.
        reason = app.state.engine.dead
        if reason:
            return _error(503, f"the engine is down: {reason}")
        replicas = app.state.engine.replicas
        if replicas is not None:  # data parallel: 200 while at least one replica serves
            serving = sum(r["state"] == "up" for r in replicas)
            return JSONResponse({"status": "ok" if serving else "unavailable", "serving": serving,
                                 "replicas": replicas}, status_code=200 if serving else 503)
        return Response(status_code=200)

    @app.get("/version", tags=["service"], response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", tags=["service"], response_class=Response)
    async def metrics() -> Response:
        engine = app.state.engine
        stats = None if engine.dead else await engine.stats()
        body = app.state.metrics.render(stats) + engine.replica_metrics().encode()
        return Response(body, media_type=CONTENT_TYPE)


# ---------------------------------------------------------------- errors


def _error(status: int, message: str, param: str | None = None, type: str | None = None,
           headers: Mapping[str, str] | None = None) -> JSONResponse:
    """vLLM's error body: the type by status (BadRequestError, NotFoundError, ...), the
    status as `code`."""
    err = APIError(status, message, type=type, param=param)
    return JSONResponse(err.body.model_dump(), status_code=status, headers=headers)


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic errors -> ("field.path: what is wrong; ...", top-level field name)."""
    parts, param = [], None
    for e in errors[:3]:
        loc = [str(x) for x in e.get("loc", ())]
        if loc and loc[0] == "body":
            loc = loc[1:]
        if e.get("type") == "json_invalid":
            if "recursion limit" in e.get("msg", ""):  # the parser's, not ours to raise
                return (f"body: nested deeper than {BODY_JSON_DEPTH} levels, the limit ({e['msg']})",
                        "body")
            return f"body: invalid JSON ({e.get('msg', '')})", None
        message = e.get("msg", "invalid")
        if e.get("type") == "unimplemented":  # raised for the model: name the field itself
            loc.append(e["ctx"]["field"])
        elif e.get("type") == "extra_forbidden":
            message = ("unknown field (rlserve refuses the fields it does not implement rather "
                       "than ignoring them)")
        if loc and param is None:  # a query or path parameter is named with its place
            param = ".".join(loc[:2]) if loc[0] in ("query", "path", "header") else loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {message}")
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more")
    return "; ".join(parts), param


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body.model_dump(), status_code=exc.status, headers=headers)

    # Every error class of rlserve/errors.py carries its status: this one handler answers them.
    @app.exception_handler(StatusError)
    async def status_error(_: Request, exc: StatusError) -> JSONResponse:
        err = APIError.of(exc)
        return JSONResponse(err.body.model_dump(), status_code=err.status)

    # FastAPI answers 422 by default; OpenAI clients expect 400 naming the field.
    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return _error(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # vLLM types the errors of its HTTP layer (unknown route, method) by the status's phrase.
        return _error(exc.status_code, str(exc.detail), type=error_type(exc.status_code, phrase=True),
                      headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}")


# ---------------------------------------------------------------- schema


def _limit_max_tokens_in_schema(app: FastAPI, max_model_len: int) -> None:
    """Publish the server's real bound on max_tokens (it depends on the model served)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for body in routes_openai.BODY_MODELS:
                found = body.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in found.pop("$defs", {}).items():
                    components.setdefault(name, sub)
                components.setdefault(body.__name__, found)
            for model in schema.get("components", {}).get("schemas", {}).values():
                for name, prop in model.get("properties", {}).items():
                    if name in ("max_tokens", "max_completion_tokens"):
                        for branch in prop.get("anyOf", [prop]):
                            if branch.get("type") == "integer":
                                branch["maximum"] = max_model_len
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
