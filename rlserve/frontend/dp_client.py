"""Data parallel: one front end, N engine-core replicas (`--data-parallel-size N`).

`DPEngineClient` stands where one `EngineCoreClient` stands under `AsyncEngine` (same
calls, same callbacks). It holds one connection per replica (dp_replica.py) and

- routes each new request to a replica (dp_router.py: least outstanding tokens, prompts
  sharing a prefix kept together), and aborts go where their request went (the requests
  in flight and what they owe: dp_requests.py);
- fans control calls out to every replica: pause, resume, sleep and wake-up reach all;
  the weights' calls (the trainer's group, updates, a rejoining replica's copy) belong to
  `ReplicaWeights` (dp_weights.py);
- takes a replica that dies out of rotation: its requests fail with a 503 that names it,
  or (`dp_retry_on_failure`) those that have produced nothing yet run again on another
  replica. The replica is restarted (up to `dp_max_restarts` times) and copies the current
  weights before it serves.

The server dies only when no replica is left. Replicas started elsewhere
(`config.dp_engines`, rlserve.ray) are attached by address; their restart is the
launcher's business, which then calls `attach`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec

from rlserve.config import EngineConfig
from rlserve.errors import EngineUnavailableError
from rlserve.frontend.core_client import EngineAddresses, EngineCoreClient
from rlserve.frontend.dp_replica import DOWN, STALE, STARTING, UP, Replica, call_all
from rlserve.frontend.dp_requests import InFlightRequests, TrackedRequest
from rlserve.frontend.dp_router import Router
from rlserve.frontend.dp_sleep import ReplicaSleep
from rlserve.frontend.dp_weights import ReplicaWeights
from rlserve.sampling_params import InvalidRequestError, SamplingParams
from rlserve.wire.control import Paused
from rlserve.wire.messages import (
    AbortAll,
    AnyControlCall,
    ConflictError,
    EngineDeadError,
    EngineReady,
    GetStats,
    InitWeightTransfer,
    Pause,
    ReleaseKVCache,
    Resume,
    Sleep,
    UpdateWeights,
    WakeUp,
    WeightChecksums,
)
from rlserve.wire.outputs import EngineCoreOutputs, EngineStats
from rlserve.wire.validation import sample_ids

logger = logging.getLogger(__name__)

_RESTART_DELAY_S = 0.5


class DPEngineClient:
    client_index = 0

    def __init__(self, config: EngineConfig, *, log_level: str = "info"):
        self.config = config
        self.log_level = log_level
        self.size = config.data_parallel_size
        self.tp = config.tensor_parallel_size
        self.router = Router(self.size, config.block_size)
        self.requests = InFlightRequests(self.router)
        self.dead: str | None = None
        self.closing = False
        self.on_outputs: Callable[[EngineCoreOutputs], None]  # the owner sets it before start()
        self.on_dead: Callable[[str], None] | None = None
        self.on_request_failed: Callable[[str, BaseException], None] | None = None
        self.paused: tuple[str, bool] | None = None  # the last /pause, until /resume
        self.sleep_state = ReplicaSleep(self)  # what the replicas sleep with, together (dp_sleep.py)
        self.weights = ReplicaWeights(self)  # the replicas' weights kept one version (dp_weights.py)
        self._tasks: set[asyncio.Task] = set()
        self._handlers = self._handler_table()
        self.info: EngineReady  # set by start()
        self.replicas = [Replica(i, self._connect(i)) for i in range(self.size)]  # every one loads at once

    def _connect(self, index: int, addresses: EngineAddresses | None = None) -> EngineCoreClient:
        if addresses is None and self.config.dp_engines is not None:
            e = self.config.dp_engines[index]
            addresses = EngineAddresses(e["input"], [e["output"]])
        # CPU replicas share the cores: more threads than cores makes every one spin.
        threads = None if str(self.config.device).startswith("cuda") else max(1, (os.cpu_count() or 1) // self.size)
        return EngineCoreClient(self.config.replica(index), addresses=addresses,
                                log_level=self.log_level, watch_pid=addresses is None, threads=threads)

    # -- start ---------------------------------------------------------------------------
    async def start(self) -> EngineReady:
        results = await asyncio.gather(*(self._start(r) for r in self.replicas), return_exceptions=True)
        errors = [(i, e) for i, e in enumerate(results) if isinstance(e, BaseException)]
        if errors:
            raise EngineDeadError("; ".join(f"replica {i}: {e}" for i, e in errors))
        infos = [r.info for r in self.replicas if r.info is not None]  # all of them: each started
        first = infos[0]
        self.info = msgspec.structs.replace(
            first, world_size=sum(i.world_size for i in infos),
            kv_capacity_tokens=sum(i.kv_capacity_tokens for i in infos))
        logger.info("data parallel: %d replicas of %d rank(s) each are up (engine pids %s)",
                    self.size, self.tp, ", ".join(str(i.pid) for i in infos))
        return self.info

    async def _start(self, r: Replica) -> EngineReady:
        c, inc = r.client, r.incarnation
        c.on_outputs = lambda out: self._outputs(r, inc, out)
        c.on_dead = lambda reason: self._replica_died(r, inc, reason)
        r.state = STARTING
        r.info = await c.start()
        r.weight_version = r.info.weight_version
        if inc == r.incarnation and r.state == STARTING:
            r.state = UP
        return r.info

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    stream: bool, cache_salt: str | None = None, lora_name: str | None = None) -> None:
        # LoRA with data parallel is refused at start-up (EngineConfig): no adapter names here.
        assert lora_name is None, "LoRA adapters are not routed across data-parallel replicas"
        if self.dead is not None:
            raise EngineDeadError(f"the engine is down: {self.dead}")
        hashes = self.router.block_hashes(prompt_token_ids, cache_salt)
        self._send(TrackedRequest(request_id, -1, prompt_token_ids, params, stream, cache_salt, hashes, 0))

    def _send(self, t: TrackedRequest, exclude: int | None = None) -> None:
        candidates = [r.index for r in self.replicas if r.state == UP and r.index != exclude]
        if not candidates:
            raise EngineUnavailableError("no data-parallel replica is serving now: "
                                         + "; ".join(f"replica {r.index} {r.state}"
                                                     + (f" ({r.reason})" if r.reason else "")
                                                     for r in self.replicas))
        i = self.router.choose(t.hashes, candidates)
        max_tokens = t.params.max_tokens
        if max_tokens is None:
            max_tokens = max(0, self.info.max_model_len - len(t.prompt_token_ids))
        t.replica, t.produced = i, 0
        t.owed = len(t.prompt_token_ids) + t.params.n * max_tokens
        t.samples = set(sample_ids(t.request_id, t.params.n))
        self.replicas[i].client.add_request(t.request_id, t.prompt_token_ids, t.params, t.stream,
                                            t.cache_salt)
        self.requests.sent(t)
        self.replicas[i].requests_total += 1

    def abort(self, request_ids: list[str]) -> None:
        per_replica: dict[int, list[str]] = {}
        for sid in request_ids:
            t = self.requests.by_sample.get(sid)
            if t is not None:
                per_replica.setdefault(t.replica, []).append(sid)
        for i, ids in per_replica.items():
            r = self.replicas[i]
            if r.alive:
                r.client.abort(ids)

    def _outputs(self, r: Replica, incarnation: int, out: EngineCoreOutputs) -> None:
        if incarnation != r.incarnation:
            return
        r.weight_version = out.version
        self.requests.account(out)
        self.on_outputs(out)

    # -- faults --------------------------------------------------------------------------
    def _replica_died(self, r: Replica, incarnation: int, reason: str) -> None:
        if incarnation != r.incarnation or self.closing or r.state == DOWN:
            return
        logger.error("data-parallel replica %d is down: %s", r.index, reason)
        r.state, r.reason = DOWN, reason
        lost = self.requests.on_replica(r.index)
        retried = 0
        for t in lost:
            self.requests.forget(t)
            error: BaseException = EngineDeadError(
                f"data-parallel replica {r.index} died while running this request: {reason}")
            # Retry only what nothing has been said about yet: no token of it left the engine.
            if self.config.dp_retry_on_failure and not t.retried and t.produced == 0:
                t.retried = True
                try:
                    self._send(t, exclude=r.index)
                    retried += 1
                    continue
                except EngineUnavailableError as e:
                    error = EngineDeadError(f"{error}; no other replica to retry on ({e})")
            if self.on_request_failed is not None:
                self.on_request_failed(t.request_id, error)
        self.router.forget(r.index)  # after the lost requests were paid off
        if self.weights.in_group(r):  # a trainer's push would wait for its ranks' answers
            self.spawn(self.weights.break_group(
                f"data-parallel replica {r.index} died ({reason}), and its ranks with it: call "
                "/init_weight_transfer_engine again once /health reports every replica up"))
        if lost:
            logger.warning("replica %d: %d requests in flight, %d retried elsewhere, %d failed",
                           r.index, len(lost), retried, len(lost) - retried)
        restart = self.config.dp_engines is None and r.restarts < self.config.dp_max_restarts
        if restart:
            self.spawn(self._restart(r))
        self._check_any_left(f"replica {r.index}: {reason}")

    def _check_any_left(self, last: str) -> None:
        """With no replica serving or on its way, the server is down (it exits)."""
        if self.dead is None and not any(x.alive or x.state == STARTING for x in self.replicas):
            self.dead = f"every data-parallel replica is down (last: {last})"
            if self.on_dead is not None:
                self.on_dead(self.dead)

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, r: Replica, addresses: EngineAddresses | None = None) -> None:
        """Start replica r again (here, or attach to one started at `addresses`), bring it
        to the current weights, then put it back in rotation."""
        r.restarts += 1
        r.incarnation += 1
        r.state = STARTING
        await r.client.shutdown()
        await asyncio.sleep(_RESTART_DELAY_S)
        if self.closing:
            return
        logger.info("restarting data-parallel replica %d (restart %d)", r.index, r.restarts)
        r.client = self._connect(r.index, addresses)
        incarnation = r.incarnation
        try:
            await self._start(r)
        except Exception as e:
            if incarnation != r.incarnation or r.state != STARTING:
                return  # its death was reported too, and dealt with there
            r.state, r.reason = DOWN, f"restart failed: {e}"
            logger.error("data-parallel replica %d: %s", r.index, r.reason)
            if self.config.dp_engines is None:
                self._check_any_left(f"replica {r.index}: {r.reason}")
            return
        r.state = STALE
        r.reason = "joining: copying the current weights"
        await self.weights.catch_up(r)

    async def attach(self, index: int, input_address: str, output_address: str) -> None:
        """A replica started elsewhere in place of replica `index` (rlserve.ray)."""
        if not 0 <= index < self.size:
            raise InvalidRequestError(f"index: must be in [0, {self.size}), got {index}", "index")
        r = self.replicas[index]
        if r.alive or r.state == STARTING:
            raise ConflictError(f"replica {index} is {r.state}: only a down replica is replaced")
        await self._restart(r, EngineAddresses(input_address, [output_address]))

    # -- control calls -------------------------------------------------------------------
    async def call(self, body: AnyControlCall) -> Any:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is down: {self.dead}")
        handler = self._handlers.get(type(body))
        if handler is not None:
            return await handler(body)
        values = list((await self.fan_out(body)).values())
        return values[0] if values else None

    def _handler_table(self) -> dict[type, Callable[[Any], Any]]:
        """The calls that are more than "every live replica, the first answer"."""
        return {InitWeightTransfer: self.weights.init_transfer, UpdateWeights: self.weights.update,
                GetStats: self._stats_call, Pause: self._pause, Resume: self._resume,
                Sleep: self.sleep_state.call, ReleaseKVCache: self.sleep_state.call, WakeUp: self._wake_up,
                AbortAll: self._abort_all, WeightChecksums: self._all_answers}

    async def _stats_call(self, body: GetStats) -> EngineStats:
        return await self.stats()

    async def _pause(self, body: Pause) -> Paused:
        self.paused = (body.mode, body.clear_cache)  # a replica that rejoins is paused alike
        values: list[Paused] = list((await self.fan_out(body)).values())
        kept = [v.kept for v in values if v.mode == "keep" and v.kept is not None]
        if kept:
            return Paused("keep", sum(kept))
        return values[0]

    async def _resume(self, body: Resume) -> None:
        self.paused = None
        await self.fan_out(body)

    async def _wake_up(self, body: WakeUp) -> None:
        await self.sleep_state.call(body)
        if not self.sleep_state.weights_asleep:  # a replica that joined meanwhile copies them now
            for r in self.replicas:
                if r.state == STALE and not self.weights.in_group(r):
                    self.spawn(self.weights.catch_up(r))

    async def _abort_all(self, body: AbortAll) -> int:
        return sum((await self.fan_out(body)).values())

    async def _all_answers(self, body: AnyControlCall) -> list:
        """Each replica's answer (a list per replica: one item per rank), one after another."""
        return [item for _, v in sorted((await self.fan_out(body)).items()) for item in v]

    async def fan_out(self, body: AnyControlCall) -> dict[int, Any]:
        """The call on every live replica; all answers, or the errors, per replica."""
        targets = [r for r in self.replicas if r.alive]
        if not targets:
            raise EngineUnavailableError("no data-parallel replica is up")
        return await call_all(targets, lambda r: body)

    async def stats_of(self, r: Replica) -> EngineStats:
        s: EngineStats = await r.client.call(GetStats())
        r.weight_version = s.weight_version
        return s

    async def stats(self) -> EngineStats:
        alive = [r for r in self.replicas if r.alive]
        if not alive:
            raise EngineUnavailableError("no data-parallel replica is up")
        got = await asyncio.gather(*(self.stats_of(r) for r in alive), return_exceptions=True)
        stats = [(r, s) for r, s in zip(alive, got) if not isinstance(s, BaseException)]
        if not stats:  # every one failed
            raise next(e for e in got if isinstance(e, BaseException))
        serving = [s for r, s in stats if r.state == UP] or [s for _, s in stats]
        return EngineStats.merge([s for _, s in stats], serving)

    # -- what /health and /metrics show ------------------------------------------------------
    def status(self) -> list[dict]:
        return [{"replica": r.index, "state": r.state, "reason": r.reason or None,
                 "weight_version": r.weight_version, "restarts": r.restarts,
                 "pid": r.info.pid if r.info is not None else None,
                 "requests_total": r.requests_total,
                 "requests_in_flight": len(self.requests.on_replica(r.index)),
                 "outstanding_tokens": self.router.load[r.index]} for r in self.replicas]

    def render_metrics(self) -> str:
        rows = self.status()
        lines = []
        for name, kind, help_, key in (
                ("rlserve_dp_requests_total", "counter", "Requests routed to each replica.", "requests_total"),
                ("rlserve_dp_requests_in_flight", "gauge", "Requests in flight on each replica.",
                 "requests_in_flight"),
                ("rlserve_dp_outstanding_tokens", "gauge",
                 "Tokens each replica owes (prompts + n x max_tokens - produced).", "outstanding_tokens"),
                ("rlserve_dp_replica_up", "gauge", "1 while the replica serves.", None),
                ("rlserve_dp_replica_restarts_total", "counter", "Restarts of each replica.", "restarts")):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            for row in rows:
                value = (1 if row["state"] == UP else 0) if key is None else row[key]
                lines.append(f'{name}{{engine="{row["replica"]}"}} {value}')
        return "\n".join(lines) + "\n"

    # -- stop ----------------------------------------------------------------------------
    async def shutdown(self, timeout_s: float = 30.0) -> None:
        self.closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(r.client.shutdown(timeout_s) for r in self.replicas if r.client is not None),
                             return_exceptions=True)
