"""The engine-core process: the step loop, fed by API servers over ZeroMQ.

    python -m rlserve.engine.core_proc --input ADDR --output ADDR [--output ADDR ...]
    (the EngineConfig arrives as msgpack on stdin)

The API server (server/) parses HTTP, tokenizes and detokenizes; this process only
schedules and steps, so none of that front-end work takes the GIL from the loop that
feeds the device. The loop (`EngineCoreProc.run`) reads whatever messages have arrived,
takes one engine step, and hands the step's outputs to a sender thread (output_sender.py),
which encodes them and sends one message per step to each API server.

Control calls run between two steps, so none ever sees a half-applied change; each is one
typed message (messages.py), answered through `_answer`. Weight updates belong to
WeightUpdates (weight_updates.py): the parts that wait on a trainer run on its threads,
and the loop calls its `apply_received` between two steps. Whether the engine is paused or
asleep, and which pause(wait) calls still wait, is EngineCore's state (state.py). This
module is transport.

Lifecycle: the process takes its orders from the API server that started it. SIGINT and
SIGTERM are ignored (Ctrl-C or `kill -TERM -PGID` reach the whole process group; the API
server lets requests finish or aborts them, then sends `shutdown`, which stops the loop,
the tensor-parallel workers and the process, exit 0). If the API server dies, this process
is killed with it (see process.py). An error in the loop is fatal: every API server is
told why (EngineDead) and the process exits 1.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from rlserve import envs
from rlserve.engine.core import EngineCore
from rlserve.engine.output_sender import OutputSender, split_by_client
from rlserve.engine.weight_updates import LATER, Handler, WeightUpdates
from rlserve.errors import EngineUnavailableError
from rlserve.process import profiled, watch_parent
from rlserve.sampling_params import InvalidRequestError
from rlserve.weight_transfer.address import get_ip
from rlserve.wire.control import Paused
from rlserve.wire.messages import (
    AbortAll,
    AbortRequests,
    AddRequest,
    Call,
    CallResult,
    EngineDead,
    EngineInput,
    EngineReady,
    GetStats,
    ListLoRAAdapters,
    LoadLoRAAdapter,
    Pause,
    ReleaseKVCache,
    ResetPrefixCache,
    Resume,
    Shutdown,
    Sleep,
    UnloadLoRAAdapter,
    WakeUp,
    error_result,
)
from rlserve.wire.outputs import EngineCoreOutputs, Rejected

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100  # an idle loop still looks at its workers' health this often
_LARGE_FRAME_BYTES = 1 << 20  # decoded with the cyclic collector paused
_SOON_POLL_MS = 2  # how soon a compiled grammar's request starts, or a received update applies


class EngineCoreProc:
    def __init__(self, input_address: str, output_addresses: list[str]):
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.bind(input_address)
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.num_clients = len(output_addresses)
        self.sender = OutputSender(self.ctx, output_addresses)  # output_sender.py
        # start() sets these, before anything else reads them.
        self.core: EngineCore
        self.updates: WeightUpdates  # live weight updates (weight_updates.py)
        self._handlers: dict[type, Handler] = {}
        self.owners: dict[str, int] = {}  # sample id -> API server, with several of them
        self.stopping = False

    # -- output ------------------------------------------------------------------------
    def _send(self, client: int | None, message: Any) -> None:
        if isinstance(message, EngineCoreOutputs):  # the label the tokens' weights were served under
            message.label = self.core.weight_labels.get(message.version)
        self.sender.send(client, message)

    def _emit(self, out: EngineCoreOutputs) -> None:
        if self.num_clients == 1:
            self._send(0, out)
            return
        for client, part in split_by_client(out, self.owners).items():
            self._send(client, part)

    def _answer(self, call: Call, value: Any = None, error: BaseException | None = None) -> None:
        """Answer a control call (thread-safe: the sender thread sends it)."""
        result = CallResult(call.call_id, True, value) if error is None else error_result(call.call_id, error)
        self._send(call.client, result)

    # -- the loop ----------------------------------------------------------------------
    def start(self, core_factory: Callable[[], EngineCore]) -> None:
        """Build the engine and tell every API server it is ready."""
        core = self.core = core_factory()
        transfer = core.config.weight_transfer
        self.updates = WeightUpdates(core, self._answer, transfer.timeout_s if transfer is not None else 120.0)
        self._handlers = self._handler_table()
        self.later: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # from threads, for the loop
        self.pending_later = 0  # loop thread only
        self._send(
            None,
            EngineReady(
                max_model_len=core.max_model_len,
                vocab_size=core.vocab_size,
                world_size=core.world_size,
                eos_token_ids=sorted(core.eos_token_ids),
                weight_version=core.weight_version,
                kv_capacity_tokens=core.kv.capacity_tokens,
                model_type=core.executor.info.model_type,
                device=str(core.device),
                dtype=str(core.executor.info.dtype).removeprefix("torch."),
                load_seconds=core.load_seconds,
                pid=os.getpid(),
                host=get_ip(),
                memory=core.memory,
                moe=core.moe,
                routed_experts=core.kv.routes is not None,
            ),
        )

    def run(self) -> None:
        core, updates = self.core, self.updates
        while not self.stopping:
            soon = bool(core.grammars) or updates.busy or updates.transaction is not None or self.pending_later > 0
            self._read_inputs(block=not core.has_work(), timeout_ms=_SOON_POLL_MS if soon else _IDLE_POLL_MS)
            updates.apply_received()  # between two steps
            self._run_later()
            if core.has_work() or bool(core.grammars):
                out = core.step()
                if out is not None:
                    self._emit(out)
            else:  # nothing steps, so nothing would notice a lost rank
                core.executor.check_health()
            if core.state.waits:
                self._answer_waits()

    def _read_inputs(self, block: bool, timeout_ms: int = _IDLE_POLL_MS) -> None:
        sock = self.input
        if block and not sock.poll(timeout_ms):
            return
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = self._decode(frame.buffer)
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequests):
                self._abort(message.request_ids)
            else:
                self._call(message)

    def _decode(self, buffer: memoryview) -> Any:
        # A large control document (an IPC update of a per-expert MoE checkpoint is some
        # 200,000 values) would trigger hundreds of collections scanning what it builds:
        # 16 ms instead of 10 to decode that one. One collection later sees it all once.
        if len(buffer) < _LARGE_FRAME_BYTES or not gc.isenabled():
            return self.decoder.decode(buffer)
        gc.disable()
        try:
            return self.decoder.decode(buffer)
        finally:
            gc.enable()

    def _add(self, m: AddRequest) -> None:
        core = self.core
        try:
            if core.state.refuses_new_requests:
                raise EngineUnavailableError(
                    f"generation is paused (mode {core.state.pause_mode}); send the request again after POST /resume"
                )
            reqs = core.make_requests(m.prompt_token_ids, m.params, m.request_id, m.stream, m.cache_salt, m.lora_name)
            for req in reqs:
                core.add_request(req)
        except (InvalidRequestError, EngineUnavailableError) as e:
            self._send(m.client, EngineCoreOutputs(core.weight_version, rejected=[Rejected.of(m.request_id, e)]))
            return
        if self.num_clients > 1:
            for req in reqs:
                self.owners[req.request_id] = m.client

    def _abort(self, request_ids: list[str]) -> None:
        finished = self.core.abort(request_ids)
        if finished:
            self._emit(EngineCoreOutputs(self.core.weight_version, finished=finished))

    # -- control calls ------------------------------------------------------------------
    def _call(self, call: Call) -> None:
        try:
            value = self._handlers[type(call.body)](call, call.body)
        except Exception as e:
            self._answer(call, error=e)
            return
        if value is not LATER:
            self._answer(call, value)

    def _pause(self, call: Call, body: Pause) -> Paused | object:  # object: LATER
        finished = self.core.pause(body.mode, body.clear_cache)
        if finished:
            self._emit(EngineCoreOutputs(self.core.weight_version, finished=finished))
        if body.mode != "wait":
            return Paused(body.mode)
        self.core.state.waits.append(call)
        self._answer_waits()
        return LATER

    def _answer_waits(self) -> None:
        """Answer the pause(wait) calls whose condition holds (EngineCore.settled_waits)."""
        for call, answer in self.core.settled_waits():
            if isinstance(answer, Exception):
                self._answer(call, error=answer)
            else:
                self._answer(call, answer)

    def _sleep(self, call: Call, body: Sleep) -> None:
        if body.level >= 1:  # staged parts would land on weights that moved, or are gone
            self.updates.end(f"/sleep?level={body.level} came while it was open")
        if body.level == 2 and not self.core.state.no_weights:  # also a level-1 sleep deepened
            # Nothing runs again until a full update: the requests in flight end now, with
            # finish_reason "abort" (vLLM's sleep aborts them too), never an answer-less wait.
            self._abort(self.core.unfinished_ids())
        out = self.core.sleep(body.level)
        if out is not None:
            self._emit(out)

    def _release_kv_cache(self, call: Call, body: ReleaseKVCache) -> None:
        out = self.core.release_kv_cache()
        if out is not None:
            self._emit(out)

    def _load_lora(self, call: Call, body: LoadLoRAAdapter) -> Any:
        """Files are read and checked on a thread (a slow disk, a large adapter or a bad
        file never holds the steps); the loop installs what was read between two steps."""
        lora = self.core.require_lora()

        def read() -> None:
            try:
                done = lora.read(body.lora_name, body.lora_path, body.load_inplace)
            except Exception as e:
                self.later.put(functools.partial(self._answer, call, error=e))
                return
            self.later.put(
                functools.partial(self._call_now, call, functools.partial(self.core.install_lora_adapter, done))
            )

        self.pending_later += 1
        threading.Thread(target=read, name="rlserve-lora-read", daemon=True).start()
        return LATER

    def _call_now(self, call: Call, fn: Callable[[], Any]) -> None:
        try:
            value = fn()
        except Exception as e:
            self._answer(call, error=e)
        else:
            self._answer(call, value)

    def _run_later(self) -> None:
        """What threads finished, run on the loop's thread between two steps."""
        while self.pending_later:
            try:
                fn = self.later.get_nowait()
            except queue.Empty:
                return
            self.pending_later -= 1
            fn()

    def _abort_all(self, call: Call, body: AbortAll) -> int:
        ids = self.core.unfinished_ids()
        self._abort(ids)
        return len(ids)

    def _shutdown(self, call: Call, body: Shutdown) -> None:
        self.updates.abandon("the server is shutting down")
        self.stopping = True

    def _handler_table(self) -> dict[type, Handler]:
        core = self.core
        return {
            **self.updates.handlers,  # weight updates: weight_updates.py
            Pause: self._pause,
            Sleep: self._sleep,
            AbortAll: self._abort_all,
            Shutdown: self._shutdown,
            Resume: lambda call, body: core.resume(),
            WakeUp: lambda call, body: core.wake_up(body.tags),
            ReleaseKVCache: self._release_kv_cache,
            ResetPrefixCache: lambda call, body: core.reset_prefix_cache(),
            GetStats: lambda call, body: core.stats(),
            ListLoRAAdapters: lambda call, body: core.list_lora_adapters(),
            LoadLoRAAdapter: self._load_lora,
            UnloadLoRAAdapter: lambda call, body: core.unload_lora_adapter(body.lora_name),
        }

    # -- end ---------------------------------------------------------------------------
    def die(self, reason: str) -> None:
        self._send(None, EngineDead(reason))

    def close(self) -> None:
        self.sender.close()
        self.input.close(linger=0)
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the rlserve engine-core process")
    parser.add_argument("--input", required=True, help="ZeroMQ address to bind for requests")
    parser.add_argument(
        "--output",
        action="append",
        required=True,
        help="ZeroMQ address of an API server's output socket (one per server)",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides what they mean
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(os.getppid())

    import msgpack

    from rlserve.config import EngineConfig

    config = EngineConfig(**msgpack.unpackb(sys.stdin.buffer.read(), raw=False))
    proc = EngineCoreProc(args.input, args.output)
    try:
        proc.start(lambda: EngineCore(config))
    except Exception as e:
        logger.exception("the engine failed to start")
        proc.die(f"the engine failed to start: {type(e).__name__}: {e}")
        proc.close()
        return 1
    code = 0
    # RLSERVE_ENGINE_PROFILE=PATH: a cProfile of the loop, written to PATH at exit.
    with profiled(envs.RLSERVE_ENGINE_PROFILE.get()):
        try:
            proc.run()
        except Exception as e:
            logger.error("engine loop died: %s", traceback.format_exc())
            proc.die(f"engine loop died: {type(e).__name__}: {e}")
            code = 1
    proc.core.shutdown()
    proc.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
