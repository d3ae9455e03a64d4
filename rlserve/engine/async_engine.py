"""The asyncio front of the engine, for the server.

One background thread owns the EngineCore and runs the step loop; coroutines talk to it
through a command queue and receive outputs through per-request asyncio queues. The event
loop never waits on a model step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from rlserve.config import EngineConfig
from rlserve.engine.core import EngineCore, EngineStats
from rlserve.engine.output_processor import RequestState
from rlserve.engine.request import EngineOutput, InvalidRequestError, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class WeightUpdateResult:
    weight_version: int
    num_bytes: int
    receive_seconds: float
    apply_seconds: float


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; every request fails with this."""


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.model_name = config.name
        self._commands: queue.Queue[tuple[Callable[[EngineCore], Any], Future]] = queue.Queue()
        # request id (child) -> (loop, queue of EngineOutput or Exception)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._children: dict[str, list[str]] = {}  # request id -> its sample ids
        self._ids = itertools.count()
        self._stop = False
        self._update_lock = asyncio.Lock()
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rlserve-engine", daemon=True)
        self._thread.start()

    # -- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        try:
            while not self._stop:
                block = not core.has_work()
                try:
                    while True:
                        fn, fut = self._commands.get(block=block, timeout=0.5 if block else None)
                        block = False
                        if fut.set_running_or_notify_cancel():
                            try:
                                fut.set_result(fn(core))
                            except BaseException as e:  # reported to the caller
                                fut.set_exception(e)
                except queue.Empty:
                    pass
                if core.has_work():
                    self._deliver(core.step())
        except BaseException as e:
            logger.exception("engine loop died")
            self.dead = e
            for rid in list(self._streams):
                self._push(rid, EngineDeadError(f"engine loop died: {type(e).__name__}: {e}"))

    def _push(self, rid: str, item) -> None:
        entry = self._streams.get(rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            self._push(out.request_id, out)

    def call(self, fn: Callable[[EngineCore], Any]) -> Future:
        """Run fn(core) in the engine thread between two steps."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead}")
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut

    async def run(self, fn: Callable[[EngineCore], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    # -- public API --------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.core.weight_version

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, prompt: str | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        request_id = request_id or f"req-{next(self._ids)}"
        requests = self.core.make_requests(prompt_token_ids, params, request_id)  # validates
        state = RequestState(request_id, prompt, prompt_token_ids, params.n, params.logprobs is not None)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        child_ids = [r.request_id for r in requests]
        for rid in child_ids:
            self._streams[rid] = (loop, q)
        self._children[request_id] = child_ids

        def add(core: EngineCore) -> None:
            for r in requests:
                core.add_request(r)

        finished = False
        try:
            await self.run(add)
            while not finished:
                item = await q.get()
                batch = [item]
                while not q.empty():  # coalesce what is already there into one snapshot
                    batch.append(q.get_nowait())
                for it in batch:
                    if isinstance(it, BaseException):
                        raise it
                    state.add(it)
                finished = state.finished
                yield state.snapshot()
        finally:
            for rid in child_ids:
                self._streams.pop(rid, None)
            self._children.pop(request_id, None)
            if not finished:  # consumer left early: free the request's KV blocks
                try:
                    self.call(lambda core: core.abort(child_ids))
                except EngineDeadError:
                    pass

    async def abort(self, request_id: str) -> None:
        ids = self._children.get(request_id, [request_id])

        def do(core: EngineCore) -> list[EngineOutput]:
            outs = core.abort(ids)
            self._deliver(outs)
            return outs

        await self.run(do)

    # -- control plane -----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.core.world_size

    @property
    def is_paused(self) -> bool:
        return self.core.paused

    async def pause(self, mode: str = "abort", clear_cache: bool = False) -> None:
        """Stop producing tokens; for `wait`, return once in-flight requests have finished."""
        def do(core: EngineCore) -> None:
            self._deliver(core.pause(mode, clear_cache))

        await self.run(do)
        if mode == "wait":
            while not await self.run(lambda core: core.drained):
                await asyncio.sleep(0.01)

    async def resume(self) -> None:
        await self.run(lambda core: core.resume())

    @property
    def is_sleeping(self) -> bool:
        return self.core.sleeping

    async def sleep(self, level: int = 1) -> None:
        def do(core: EngineCore) -> None:
            self._deliver(core.sleep(level))

        await self.run(do)

    async def wake_up(self) -> None:
        await self.run(lambda core: core.wake_up())

    async def init_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's group; blocks (off the event loop) until the group forms."""
        from rlserve.weight_transfer import InitInfo
        from rlserve.weight_transfer.ipc import parse_ipc_init_info
        cfg = self.config.weight_transfer
        if cfg is None:
            raise InvalidRequestError("no weight-transfer backend is configured", "init_info")
        if cfg.backend == "ipc":
            parse_ipc_init_info(init_info)
        else:
            InitInfo.parse(init_info, num_workers=self.world_size)  # a 400 before anything blocks
        async with self._update_lock:
            await asyncio.to_thread(self.core.executor.collective_rpc, "init_weight_transfer",
                                    cfg.backend, init_info, cfg.timeout_s)

    async def update_weights(self, update_info: dict) -> WeightUpdateResult:
        """Receive a whole update into staging, then swap it in between two steps.

        Generation goes on while the bytes arrive (unless paused); a failed or refused
        transfer leaves the previous weights serving.
        """
        version = update_info.get("weight_version") if isinstance(update_info, dict) else None
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise InvalidRequestError(f"update_info.weight_version: must be an integer, got {version!r}",
                                      "weight_version")
        if self.core.sleeping:  # refused before the group is touched
            raise InvalidRequestError("the server is asleep: POST /wake_up before updating weights",
                                      "update_info")
        async with self._update_lock:
            t0 = time.perf_counter()
            try:
                sizes = await asyncio.to_thread(self.core.executor.collective_rpc,
                                                "receive_weights", update_info)
            except BaseException:
                self.core.executor.collective_rpc("drop_staged_weights")
                raise
            t1 = time.perf_counter()
            new_version = await self.run(lambda core: core.apply_staged_weights(version))
            t2 = time.perf_counter()
        result = WeightUpdateResult(new_version, sizes[0], t1 - t0, t2 - t1)
        logger.info("weights updated to version %d: %.1f MB received in %.3fs, applied in %.3fs",
                    new_version, result.num_bytes / 1e6, result.receive_seconds, result.apply_seconds)
        return result

    def stats(self) -> EngineStats:
        return self.core.stats()

    async def reset_prefix_cache(self) -> None:
        await self.run(lambda core: core.reset_prefix_cache())

    def shutdown(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self.core.shutdown()
