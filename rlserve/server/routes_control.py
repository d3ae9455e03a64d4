"""The weight-update control plane, wire-compatible with the seed script:

    GET  /get_world_size                -> {"world_size": N}
    POST /init_weight_transfer_engine   {"init_info": {...}}     blocks until the group forms
    POST /update_weights                {"update_info": {...}}   blocks until loaded
    POST /pause?mode=abort|wait|keep&clear_cache=false
    POST /resume
    GET  /is_paused, GET /weight_version, POST /reset_prefix_cache
    POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping

These routes exist only when a weight-transfer backend is configured (the sleep routes
also with --enable-sleep-mode). They answer only loopback clients, or with `--admin-key`
only requests bearing it, and never cross-origin browser requests: see
rlserve/server/security.py.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from rlserve.config import EngineConfig
from rlserve.server.limits import check_int_range
from rlserve.server.protocol import APIError
from rlserve.server.security import require_control_access


class InitWeightTransferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: dict[str, Any] = Field(description="master_address, master_port, rank_offset, world_size")


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    update_info: dict[str, Any] = Field(
        description="names, dtype_names, shapes, packed, packed_buffer_size_bytes, "
                    "packed_num_buffers, weight_version (optional)")


router = APIRouter(tags=["weight updates"], dependencies=[Depends(require_control_access)])


def _engine(request: Request):
    return request.app.state.engine


def _transfer_error(e: Exception) -> APIError:
    from rlserve.weight_transfer import InvalidUpdateError, WeightTransferError
    if isinstance(e, InvalidUpdateError):
        return APIError(400, str(e), param="update_info")
    if isinstance(e, WeightTransferError):
        # The trainer side failed or vanished: not the caller's input, not a server bug.
        return APIError(502, f"weight transfer failed, previous weights still serving: {e}",
                        type="weight_transfer_error")
    raise e


async def _unless_stopping(request: Request, call: Awaitable, what: str):
    """`call`'s result, or a 503 as soon as the server starts shutting down: a group that
    never forms, or a trainer that stalls, would otherwise hold the shutdown until its
    timeout and end in a cancelled task's traceback."""
    task = asyncio.ensure_future(call)
    stopping = asyncio.ensure_future(request.app.state.stopping.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise APIError(503, f"{what}: the server is shutting down; nothing was changed",
                   type="service_unavailable")


@router.get("/get_world_size")
async def get_world_size(request: Request) -> dict:
    return {"world_size": _engine(request).world_size}


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: InitWeightTransferRequest, request: Request) -> dict:
    check_int_range(body.init_info, "init_info")
    try:
        await _unless_stopping(request, _engine(request).init_weight_transfer(body.init_info),
                               "init_weight_transfer_engine")
    except APIError:
        raise
    except Exception as e:
        raise _transfer_error(e) from e
    return {"status": "ok"}


@router.post("/update_weights")
async def update_weights(body: UpdateWeightsRequest, request: Request) -> dict:
    metrics = request.app.state.metrics
    check_int_range(body.update_info, "update_info")
    try:
        result = await _unless_stopping(request, _engine(request).update_weights(body.update_info),
                                        "update_weights")
    except APIError:
        metrics.weight_update(False, 0.0)
        raise
    except Exception as e:
        metrics.weight_update(False, 0.0)
        raise _transfer_error(e) from e
    metrics.weight_update(True, result.receive_seconds + result.apply_seconds, result.num_bytes)
    gbps = result.num_bytes / max(result.receive_seconds, 1e-9) / 1e9
    answer = {"status": "ok", "weight_version": result.weight_version, "bytes": result.num_bytes,
              "receive_seconds": result.receive_seconds, "apply_seconds": result.apply_seconds,
              "gb_per_second": gbps}
    if result.replicas is not None:
        answer["replicas"] = result.replicas
    return answer


@router.post("/pause")
async def pause(request: Request,
                mode: str = Query("abort", pattern="^(abort|wait|keep)$",
                                  description="abort: end in-flight requests; wait: let them "
                                              "finish; keep: freeze them with their KV cache"),
                clear_cache: bool = Query(False, description="keep mode: drop frozen requests' "
                                                             "KV so they re-prefill on resume")) -> dict:
    """Answers once its mode holds. `wait` answers when the requests in flight have
    finished, or with mode `keep` when they cannot run (a sleep came first, or a keep-pause
    while it waited: they are kept and continue after /resume), or 409 if /resume came
    first; after a keep-pause with requests frozen it is a 409 at once (resume first)."""
    answer = await _engine(request).pause(mode, clear_cache)
    return {"status": "paused", **answer}


@router.post("/resume")
async def resume(request: Request) -> dict:
    await _engine(request).resume()
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict:
    return {"is_paused": (await _engine(request).stats()).paused}


# Without a weight-transfer backend, --enable-sleep-mode gives these three alone.
sleep_router = APIRouter(tags=["sleep"], dependencies=[Depends(require_control_access)])


@sleep_router.post("/sleep")
async def sleep(request: Request,
                level: int = Query(1, ge=1, le=2, description="1: weights to host memory; "
                                                              "2: weights dropped (the next "
                                                              "update must send them all)")) -> dict:
    await _engine(request).sleep(level)
    return {"status": "sleeping", "level": level}


@sleep_router.post("/wake_up")
async def wake_up(request: Request) -> dict:
    await _engine(request).wake_up()
    return {"status": "awake"}


@sleep_router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    return {"is_sleeping": (await _engine(request).stats()).sleeping}


@router.get("/weight_version")
async def weight_version(request: Request) -> dict:
    return {"weight_version": (await _engine(request).stats()).weight_version}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    await _engine(request).reset_prefix_cache()
    return {"status": "ok"}


def add_control_routes(app: FastAPI, engine, config: EngineConfig) -> None:
    app.include_router(router)
    app.include_router(sleep_router)


def add_sleep_routes(app: FastAPI) -> None:
    app.include_router(sleep_router)
