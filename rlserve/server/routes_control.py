"""The weight-update control plane, wire-compatible with vLLM's RLHF-over-HTTP example and with today's
vLLM (paths, bodies and answers as its RLHF routes have them):

    GET  /get_world_size?include_dp=true -> {"world_size": N}
    POST /init_weight_transfer_engine   {"init_info": {...}}     blocks until the group forms
    POST /update_weights                {"update_info": {...}}   blocks until loaded (or staged)
    POST /start_weight_update           {"is_checkpoint_format": true}   opens a transaction
    POST /finish_weight_update          {"weight_version": "..."}         commits all of it, or none
    POST /abort_requests                {"request_ids": [...]}   (none or empty: every request)
    POST /update_weight_version {"new_version"}, GET /weight_info, POST /weight_checker,
    POST /shutdown_weight_transfer_engine
    POST /pause?mode=abort|wait|keep&clear_cache=true
    POST /resume
    GET  /is_paused, GET /weight_version, POST /reset_prefix_cache
    POST /sleep?level=0|1|2, POST /wake_up?tags=weights|kv_cache, GET /is_sleeping,
    POST /release_kv_cache_memory

These routes exist only when a weight-transfer backend is configured (the sleep routes
also with --enable-sleep-mode). They answer only loopback clients, or with `--admin-key`
only requests bearing it, and never cross-origin browser requests: see
rlserve/server/security.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Iterator
from typing import Any, Literal

import msgspec
from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from rlserve.errors import ConflictError, EngineUnavailableError, InvalidRequestError, InvalidUpdateError
from rlserve.server.security import require_control_access
from rlserve.wire.limits import check_int_range


class InitWeightTransferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: dict[str, Any] = Field(description="master_address, master_port, rank_offset, world_size")


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    update_info: dict[str, Any] = Field(
        description="names, dtype_names, shapes, packed, packed_buffer_size_bytes, "
                    "packed_num_buffers, weight_version (optional)")


_TRANSACTION_ID = Field(None, max_length=128, description="the transaction's owner names it (start), and "
                                                          "names it again (finish); none: the open one")


class StartWeightUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    is_checkpoint_format: bool = Field(True, description="true: names as in the checkpoint (what rlserve takes)")
    transaction_id: str | None = _TRANSACTION_ID


# Versions are taken as any JSON value here and parsed by rlserve.wire.weight_version, the
# one parser every version field shares (a 400 naming the field, never a type error's 422).
class FinishWeightUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight_version: Any = Field(None, description="the committed weights' version: a number or a label")
    transaction_id: str | None = _TRANSACTION_ID


class UpdateWeightVersionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    new_version: Any = Field(description="a number, or a label (any printable string)")


class AbortRequestsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_ids: list[str] | None = Field(None, description="responses' ids; none or empty: every request")


class WeightCheckerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: Literal["checksum", "compare", "reset"]
    baseline: dict[str, str] | None = Field(None, description="compare: a checksum answer's checksums")


router = APIRouter(tags=["weight updates"], dependencies=[Depends(require_control_access)])


def _engine(request: Request):
    return request.app.state.engine


@contextlib.contextmanager
def _about(param: str) -> Iterator[None]:
    """An invalid init_info or update_info names the body field this call carried it in
    (the transfer's checks do not know which call that was); the app's one handler
    answers it, as every error, with its class's status."""
    try:
        yield
    except InvalidUpdateError as e:
        if e.param is None:
            e.param = param
        raise


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
    raise EngineUnavailableError(f"{what}: the server is shutting down; nothing was changed")


@router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: bool = Query(
        True, description="false: the ranks of one data-parallel replica only")) -> dict:
    engine = _engine(request)
    return {"world_size": engine.world_size if include_dp else engine.config.tensor_parallel_size}


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: InitWeightTransferRequest, request: Request) -> dict:
    check_int_range(body.init_info, "init_info")
    with _about("init_info"):
        await _unless_stopping(request, _engine(request).init_weight_transfer(body.init_info),
                               "init_weight_transfer_engine")
    return {"status": "ok"}


@router.post("/update_weights")
async def update_weights(body: UpdateWeightsRequest, request: Request) -> dict:
    metrics, start = request.app.state.metrics, time.perf_counter()
    try:
        with _about("update_info"):
            result = await _unless_stopping(request, _engine(request).update_weights(body.update_info),
                                            "update_weights")
    except Exception:
        metrics.weight_update(False, 0.0)
        raise
    metrics.weight_update(True, result.receive_seconds + result.apply_seconds, result.num_bytes)
    gbps = result.num_bytes / max(result.receive_seconds, 1e-9) / 1e9
    answer = {"status": "ok", "message": "Weights updated", "staged": result.staged,
              "weight_version": result.weight_version,
              "weight_label": _engine(request).version_label(result.weight_version), "bytes": result.num_bytes,
              "receive_seconds": result.receive_seconds, "apply_seconds": result.apply_seconds,
              "gb_per_second": gbps,
              # From the parsed request to the engine's answer: what the trainer waited beyond it
              # is HTTP and its own side.
              "server_seconds": time.perf_counter() - start}
    if result.skipped:  # a multimodal trainer's vision tower, which this server does not hold
        answer["skipped"] = result.skipped
    if result.replicas is not None:
        answer["replicas"] = [msgspec.to_builtins(r) for r in result.replicas]
    return answer


# -- the transaction (vLLM 0.22 and later) ----------------------------------------------------

@router.post("/start_weight_update")
async def start_weight_update(request: Request, body: StartWeightUpdateRequest | None = Body(None)) -> dict:
    """Open a transaction: the /update_weights that follow stage (nothing served changes)
    until /finish_weight_update. A start while one is open is a 409 naming it (that one
    stays open for its owner; a trainer that restarted calls /init_weight_transfer_engine,
    which abandons it). The answer's `transaction_id` (the one given, or one made) may be
    carried by every part (`update_info.transaction_id`) and the finish: another id is a 409."""
    body = body or StartWeightUpdateRequest()
    return msgspec.to_builtins(await _engine(request).start_weight_update(body.is_checkpoint_format,
                                                                          body.transaction_id))


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request, body: FinishWeightUpdateRequest | None = Body(None)) -> dict:
    """Commit every staged part in one step, between two engine steps (new version, prefix
    cache reset); if any part failed, commit nothing and say what failed."""
    body = body or FinishWeightUpdateRequest()
    with _about("update_info"):  # a part that failed
        answer = await _engine(request).finish_weight_update(body.weight_version, body.transaction_id)
    return msgspec.to_builtins(answer)


# -- the other calls -----------------------------------------------------------------------------

@router.post("/abort_requests")
async def abort_requests(request: Request, body: AbortRequestsRequest | None = Body(None)) -> dict:
    """End requests now (their responses finish with finish_reason "abort"), without pausing."""
    engine = _engine(request)
    ids = (body.request_ids if body is not None else None) or []
    aborted = engine.abort_requests(ids) if ids else await engine.abort_all()
    return {"status": "aborted", "aborted": aborted}


@router.post("/update_weight_version")
async def update_weight_version(body: UpdateWeightVersionRequest, request: Request) -> dict:
    """Name the weights now served (the next tokens carry it); the weights do not change."""
    await _engine(request).update_weight_version(body.new_version)
    return {"success": True, "new_version": body.new_version}  # as given (vLLM's answer), checked


@router.get("/weight_info")
async def weight_info(request: Request) -> dict:
    stats = await _engine(request).stats()
    return {"weight_version": stats.weight_label or str(stats.weight_version)}


@router.post("/weight_checker")
async def weight_checker(body: WeightCheckerRequest, request: Request) -> dict:
    """The sha256 of each parameter's bytes as served, keyed as vLLM keys them
    (`dp{d}:pp0:pcp0:tp{t}:{name}`, one per rank's shard): `checksum` answers them,
    `compare` diffs them with a `baseline` (an earlier checksum's answer), `reset` puts
    noise over every parameter (generation answers 503 until a full update lands: nothing
    is served that no trainer sent)."""
    engine = _engine(request)
    baseline = body.baseline
    if body.action == "compare" and baseline is None:
        raise InvalidRequestError("baseline: action 'compare' needs the checksums to compare with", "baseline")
    stats = await engine.stats()
    if stats.paused or stats.sleeping:
        raise ConflictError("weight_checker requires an awake, unpaused engine")
    if body.action == "reset":
        await engine.reset_weights()
        return {"status": "reset"}
    checksums = keyed_checksums(await engine.weight_checksums(), engine.config.tensor_parallel_size)
    if body.action == "checksum":
        return {"checksums": checksums}
    assert baseline is not None  # compare: refused above without one
    mismatches = sorted(n for n in checksums.keys() | baseline.keys() if checksums.get(n) != baseline.get(n))
    return {"match": not mismatches, "mismatches": mismatches}


def keyed_checksums(per_rank: list[dict[str, str]], tp_size: int) -> dict[str, str]:
    """Every rank's digests (replicas after one another, `tp_size` ranks each), keyed
    by the rank's place as vLLM keys them (no pipeline or context parallelism here)."""
    return {f"dp{i // tp_size}:pp0:pcp0:tp{i % tp_size}:{name}": digest
            for i, digests in enumerate(per_rank) for name, digest in digests.items()}


@router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(request: Request) -> dict:
    """Leave the trainer's group (an open transaction is abandoned); init joins it again."""
    return msgspec.to_builtins(await _engine(request).shutdown_weight_transfer())


@router.post("/pause")
async def pause(request: Request,
                mode: str = Query("abort", pattern="^(abort|wait|keep)$",
                                  description="abort: end in-flight requests; wait: let them "
                                              "finish; keep: freeze them with their KV cache"),
                clear_cache: bool = Query(True, description="reset the prefix cache (abort: at once; "
                                                            "wait: once drained); keep: also drop the "
                                                            "frozen requests' KV, so they re-prefill "
                                                            "on resume (vLLM's default: true)")) -> dict:
    """Answers once its mode holds. `wait` answers when the requests in flight have
    finished, or with mode `keep` when they cannot run (a sleep came first, or a keep-pause
    while it waited: they are kept and continue after /resume), or 409 if /resume came
    first; after a keep-pause with requests frozen it is a 409 at once (resume first).
    Generation requests that arrive during an abort or wait pause are answered 503 at once
    (as in vLLM); during a keep pause they wait for /resume with the frozen ones."""
    answer = await _engine(request).pause(mode, clear_cache)
    return {"status": "paused", **msgspec.to_builtins(answer)}


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
                level: int = Query(1, ge=0, le=2, description="0: stop scheduling only (nothing is given "
                                                              "back); 1: weights to host memory; 2: weights "
                                                              "dropped (the requests in flight end with "
                                                              "finish_reason abort, and only a full update "
                                                              "brings generation back)")) -> dict:
    await _engine(request).sleep(level)
    return {"status": "sleeping", "level": level}


@sleep_router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(
        None, description="weights, kv_cache (repeatable); none: everything. /is_sleeping stays true "
                          "until everything is awake")) -> dict:
    await _engine(request).wake_up(tags)
    return {"status": "awake" if not (await _engine(request).stats()).sleeping else "sleeping"}


@sleep_router.post("/release_kv_cache_memory")
async def release_kv_cache_memory(request: Request) -> dict:
    """Give the KV cache's memory back, the weights kept; /wake_up?tags=kv_cache restores it."""
    await _engine(request).release_kv_cache()
    return {"status": "ok"}


@sleep_router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    return {"is_sleeping": (await _engine(request).stats()).sleeping}


@router.get("/weight_version")
async def weight_version(request: Request) -> dict:
    """rlserve's own (the integer vLLM's RLHF-over-HTTP example reads); vLLM's is /weight_info."""
    return {"weight_version": (await _engine(request).stats()).weight_version}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    await _engine(request).reset_prefix_cache()
    return {"status": "ok"}


def add_control_routes(app: FastAPI) -> None:
    app.include_router(router)
    app.include_router(sleep_router)


def add_sleep_routes(app: FastAPI) -> None:
    app.include_router(sleep_router)
