"""Runs the model on every tensor-parallel rank and calls methods on all of them.

Rank 0, the driver, lives in this process: one rank means no process hop. The engine
reads what it needs of rank 0 through this class (`info`, `expected_weights`,
`abort_transfer`, `lora`), never the driver itself. Ranks 1..N-1 are worker processes
(worker_proc.py; the executor's handle on each: worker_handle.py), each on a socket
carrying msgpack messages (channel.py):

- a step per engine step: the scheduler output as plain lists, and no reply. Every rank
  runs it through the same ModelRunner.launch/collect as rank 0; the step's collectives keep
  the ranks in lockstep, and rank 0 samples and broadcasts the tokens to the others
  (model_runner.py), so overlapped scheduling reads the same tokens on every rank.
- calls (`collective_rpc`, one typed message per call: calls.py), answered in order;
  results come back in rank order.

Every message goes to all workers under one lock, so all ranks see steps and calls in
the same order and a collective never pairs a step on one rank with a call on another.
A worker that exits fails the executor: the pending and every later call raises
WorkerDiedError, so the engine loop stops and says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import msgspec
import numpy as np
import torch

from rlserve.config import EngineConfig
from rlserve.distributed import DEFAULT_TIMEOUT_S, TPGroup, host_store, tp_device
from rlserve.model.moe import SparseMoeBlock
from rlserve.sequence import SchedulerOutput
from rlserve.worker.calls import RankCall, TensorCall
from rlserve.worker.channel import ChannelClosed, StepEncoder, error_from_reply, reply_error_text
from rlserve.worker.model_runner import ModelRunner, ModelRunnerOutput, StepHandle
from rlserve.worker.worker import Worker
from rlserve.worker.worker_handle import WorkerProcess

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rlserve.model.lora import LoRAModel

logger = logging.getLogger(__name__)

_POLL_S = 0.2


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank is gone (or failed a step); the engine cannot go on."""


@dataclass(frozen=True)
class ModelInfo:
    """What the engine reads of the model every rank runs (rank 0's answers for all)."""

    model_type: str  # the model class's name
    dtype: torch.dtype
    device: torch.device  # rank 0's
    hybrid: bool  # linear-attention layers beside attention (state slots, no prefix cache)
    moe: bool  # mixture-of-experts layers
    routes_shape: tuple[int, int] | None  # routing capture's (layers, top_k) while it runs


class Executor:
    """Rank 0 in this process plus one worker process per further rank."""

    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, model_path: str) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.failure: str | None = None
        self.workers: list[WorkerProcess] = []
        self._closing = False
        self._fail_lock = threading.Lock()
        self._send_lock = threading.Lock()  # one order of messages for all workers
        self._call_lock = threading.Lock()  # one call in flight: replies pair with calls
        self._steps = StepEncoder()
        self.tp = TPGroup()
        self._saved_threads: int | None = None
        try:
            if self.world_size > 1:
                self.tp = self._start_workers(config, model_path)
            self.driver = Worker(config, hf_config, model_path, rank=0, tp=self.tp)
            model, routes = self.driver.model, self.driver.runner.routes
            self.info = ModelInfo(
                type(model).__name__,
                self.driver.dtype,
                self.driver.device,
                bool(getattr(model, "hybrid", False)),
                any(isinstance(m, SparseMoeBlock) for m in model.modules()),
                None if routes is None else routes.shape,
            )
            for w in self.workers:  # each answers its init once its model is loaded
                reply = self._reply(w)
                if not reply["ok"]:
                    raise error_from_reply(reply, w.rank)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, config: EngineConfig, model_path: str) -> TPGroup:
        timeout_s = DEFAULT_TIMEOUT_S
        store = host_store(timeout_s)
        device = tp_device(config.device, 0)
        if device.startswith("cuda"):
            last = torch.device(tp_device(config.device, self.world_size - 1)).index
            if last >= torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size: {self.world_size} ranks from {device} need "
                    f"cuda:{last}, but {torch.cuda.device_count()} GPUs are visible"
                )
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        if not device.startswith("cuda"):
            # CPU ranks share the cores; more threads than cores makes every rank spin.
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
        init = {
            "op": "init",
            "config": config.to_wire(),
            "model_path": model_path,
            "world_size": self.world_size,
            "tp_port": store.port,
            "timeout_s": timeout_s,
            "num_threads": threads,
            "log_level": logging.getLogger("rlserve").getEffectiveLevel(),
        }
        for rank in range(1, self.world_size):
            self.workers.append(WorkerProcess(rank, {**init, "rank": rank}, self._on_worker_lost))
        logger.info(
            "started %d tensor-parallel workers (pids %s)",
            len(self.workers),
            ", ".join(str(w.proc.pid) for w in self.workers),
        )
        return self._unless_failed(
            lambda: TPGroup.join(0, self.world_size, device, store.port, store=store, timeout_s=timeout_s),
            "forming the tensor-parallel group",
        )

    def _unless_failed(self, fn: Callable[[], Any], what: str) -> Any:
        """Run fn, giving up as soon as a worker dies (fn may block on the dead one)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=run, name="rlserve-tp-join", daemon=True)
        t.start()
        while t.is_alive():
            t.join(_POLL_S)
            if self.failure is not None:
                raise WorkerDiedError(f"{what}: {self.failure}")
        if "error" in box:
            raise box["error"]
        return box["value"]

    # -- failure -----------------------------------------------------------------------
    def _on_worker_lost(self, w: WorkerProcess) -> None:
        if self._closing:
            return
        self._fail(w.describe_exit())

    def _fail(self, message: str) -> None:
        with self._fail_lock:
            if self.failure is not None:
                return
            self.failure = message
        logger.error("%s; the engine cannot continue", message)
        self.tp.abort()  # rank 0 may be waiting inside a collective on the lost rank

    def check_health(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    # -- messages ----------------------------------------------------------------------
    def _send_all(self, message: dict[str, Any]) -> None:
        data = msgpack.packb(message, use_bin_type=True)  # fails before anything is sent
        with self._send_lock:
            for w in self.workers:
                try:
                    w.chan.send_packed(data)
                except ChannelClosed:
                    pass  # its reader reports the loss
        self.check_health()

    def _reply(self, w: WorkerProcess) -> dict[str, Any]:
        while True:
            try:
                msg = w.replies.get(timeout=_POLL_S)
            except queue.Empty:
                self.check_health()
                continue
            if msg is None:
                w.replies.put(None)  # stays lost for later callers
                raise WorkerDiedError(self.failure or f"tensor-parallel worker rank {w.rank} is gone")
            return msg

    # -- what the engine reads of rank 0 --------------------------------------------------
    @property
    def expected_weights(self) -> dict[str, Any]:
        """Every weight name the model takes (stacked and per-expert), with its shape and dtype."""
        return self.driver.receiver.expected

    @property
    def lora(self) -> LoRAModel | None:
        """Rank 0's LoRA slots (every rank's are alike): what an adapter is checked against."""
        return self.driver.lora

    def abort_transfer(self, reason: str) -> None:
        """Fail a weight receive or group join under way, now. Only one rank in this process
        can be reached while it runs (other ranks are behind the call in flight): with
        worker processes the transfer ends by its own timeout instead."""
        if not self.workers:
            self.driver.receiver.abort(reason)

    @property
    def local_runner(self) -> ModelRunner:
        """Rank 0's model runner (and through it, its model): for tests and benchmarks that
        look inside a step. The engine itself goes through the methods here."""
        return self.driver.runner

    # -- the interface the engine uses ----------------------------------------------------
    def collective_rpc(self, call: RankCall) -> list[Any]:
        """Run `call` (calls.py) on every rank; results in rank order. Raises if any rank
        failed, with that rank's message (rank 0's own exception when it failed too)."""
        self.check_health()
        if not self.workers:
            return [call.run(self.driver)]
        data = msgspec.msgpack.encode(call)
        with self._call_lock:
            self._send_all({"op": "call", "call": data})
            local = self._call_local(lambda: call.run(self.driver))
            replies = [self._reply(w) for w in self.workers]
        return self._gather(local, replies)

    def _call_local(self, fn: Callable[[], Any]) -> tuple[bool, Any]:
        try:
            return True, fn()
        except Exception as e:
            return False, e

    def _gather(self, local: tuple[bool, Any], replies: list[dict[str, Any]]) -> list[Any]:
        failed = [(w.rank, r) for w, r in zip(self.workers, replies) if not r["ok"]]
        ok, value = local
        if not ok:
            for rank, r in failed:
                value.add_note(f"rank {rank} failed too: {reply_error_text(r)}")
            raise value
        if failed:
            error = error_from_reply(failed[0][1], failed[0][0])
            for rank, r in failed[1:]:
                error.add_note(f"rank {rank} failed too: {reply_error_text(r)}")
            raise error
        return [value] + [r["result"] for r in replies]

    def load_tensors(self, call: TensorCall, weights: Iterable[tuple[str, torch.Tensor]]) -> list[Any]:
        """Run `call` with these tensors on every rank (each keeps its shards): rank 0
        broadcasts them over the TP group, so they never travel in a message."""
        from rlserve.weight_transfer.packing import as_bytes

        self.check_health()
        tensors = [(name, t.detach()) for name, t in weights]
        if not self.workers:
            return [call.run_with(self.driver, tensors)]
        metas = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors]
        with self._call_lock:
            self._send_all({"op": "load", "tensors": metas, "call": msgspec.msgpack.encode(call)})
            for _, t in tensors:
                if t.numel():
                    self.tp.broadcast(as_bytes(t.to(self.driver.device)), src=0)
            local = self._call_local(lambda: call.run_with(self.driver, tensors))
            replies = [self._reply(w) for w in self.workers]
        return self._gather(local, replies)

    def launch(
        self,
        sched: SchedulerOutput,
        block_tables: np.ndarray | list[list[int]],
        prev: StepHandle | None = None,
        sample: bool = True,
    ) -> StepHandle:
        """Queue a step on every rank; nothing here waits for the device. `prev`, the step
        still in flight, supplies the tokens it is sampling (overlapped scheduling; each
        worker keeps its own in-flight step). `sample=False`: rank 0 samples later, in
        `sample`; the other ranks take rank 0's tokens whenever it samples."""
        self.check_health()
        with self._step_failures():
            if self.workers:
                # With worker processes the engine passes lists (EngineCore._tables).
                self._send_all(self._steps.encode(sched, block_tables))  # type: ignore[arg-type]
            return self.driver.runner.launch(sched, block_tables, prev, sample=sample)

    def sample(self, handle: StepHandle, token_bitmask: torch.Tensor | np.ndarray | None) -> None:
        """Queue the sampling of a step launched with sample=False, under a grammar mask."""
        with self._step_failures():
            self.driver.runner.sample(handle, token_bitmask)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """A launched step's results on the host: the one wait of a step."""
        with self._step_failures():
            return self.driver.runner.collect(handle)

    @contextlib.contextmanager
    def _step_failures(self) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            if not self.workers:
                raise
            # A lost peer fails rank 0's collective, maybe before its reader has noticed.
            deadline = time.monotonic() + 2
            while self.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            # Ranks that finished the step without rank 0 are now out of step with it.
            self._fail(self.failure or f"rank 0 failed a step: {type(e).__name__}: {e}")
            raise WorkerDiedError(self.failure) from e

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for w in self.workers:
            w.stop()
        self.tp.close()
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
