"""An API server's connection to the engine-core process (core_proc.py).

`EngineCoreClient` starts the process (or, for a further API server, joins one already
started), sends requests, aborts and control calls, and reads the engine's messages on the
event loop. It knows nothing of HTTP or text: async_engine.py builds on it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
import zmq
import zmq.asyncio

from rlserve.config import EngineConfig
from rlserve.process import spawn
from rlserve.sampling_params import SamplingParams
from rlserve.wire.control import reply_type
from rlserve.wire.messages import (
    AbortRequests,
    AddRequest,
    AnyControlCall,
    Call,
    CallResult,
    EngineDead,
    EngineDeadError,
    EngineOutput,
    EngineReady,
    Shutdown,
    error_from_result,
)
from rlserve.wire.outputs import EngineCoreOutputs

logger = logging.getLogger(__name__)


@dataclass
class EngineAddresses:
    """Where the engine listens, and where each API server listens for the engine."""

    input: str
    outputs: list[str] = field(default_factory=list)

    @classmethod
    def new(cls, num_clients: int) -> EngineAddresses:
        base = tempfile.mkdtemp(prefix="rlserve-")
        return cls(f"ipc://{base}/in", [f"ipc://{base}/out{i}" for i in range(num_clients)])


class EngineCoreClient:
    def __init__(self, config: EngineConfig, *, client_index: int = 0, num_clients: int = 1,
                 addresses: EngineAddresses | None = None, log_level: str = "info",
                 watch_pid: bool = True, threads: int | None = None):
        """`watch_pid=False`: an engine started elsewhere, maybe on another host, whose pid
        means nothing here; its death reaches this client as an EngineDead message.
        `threads`: the CPU threads the engine process may use (process.spawn)."""
        self.client_index = client_index
        self.watch_pid = watch_pid
        self.proc: subprocess.Popen | None = None
        if addresses is None:
            addresses = EngineAddresses.new(num_clients)
            self.proc = self._spawn(config, addresses, log_level, threads)
        self.addresses = addresses
        self.ctx = zmq.Context()
        self._input = self.ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # queue, never drop, while the engine loads
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.connect(addresses.input)
        self._output: zmq.asyncio.Socket | None = None
        self._encode = msgspec.msgpack.Encoder().encode
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.dead: str | None = None
        self.closing = False
        self._exited = asyncio.Event()
        self.on_outputs: Callable[[EngineCoreOutputs], None]  # the owner sets it before start()
        self.on_dead: Callable[[str], None] | None = None

    @staticmethod
    def _spawn(config: EngineConfig, addresses: EngineAddresses, log_level: str,
               threads: int | None) -> subprocess.Popen:
        args = ["--input", addresses.input, "--log-level", log_level]
        for out in addresses.outputs:
            args += ["--output", out]
        # It ignores SIGTERM (see core_proc.py): if this process dies, it is killed.
        return spawn("rlserve.engine.core_proc", *args, stdin=msgpack.packb(config.to_wire(), use_bin_type=True),
                     parent_death=signal.SIGKILL, threads=threads)

    # -- start -------------------------------------------------------------------------
    async def start(self) -> EngineReady:
        """Wait (on the running loop) for the engine to load; then read its messages."""
        ctx = zmq.asyncio.Context.shadow(self.ctx.underlying)
        output = self._output = ctx.socket(zmq.PULL)
        output.bind(self.addresses.outputs[self.client_index])
        decoder = msgspec.msgpack.Decoder(EngineOutput)
        loop = asyncio.get_running_loop()
        if self.proc is not None:
            threading.Thread(target=self._watch_process, args=(self.proc, loop), name="rlserve-engine-watch",
                             daemon=True).start()
        while True:
            recv = asyncio.ensure_future(output.recv(copy=False))
            exited = asyncio.ensure_future(self._exited.wait())
            await asyncio.wait({recv, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not recv.done():
                recv.cancel()
                raise EngineDeadError(self.dead or "the engine process exited while loading")
            exited.cancel()
            message = decoder.decode(recv.result().buffer)
            if isinstance(message, EngineDead):
                raise EngineDeadError(message.reason)
            if isinstance(message, EngineReady):
                break
        if self.proc is None and self.watch_pid:  # another API server started it: watch its pid
            threading.Thread(target=self._watch_pid, args=(loop, message.pid),
                             name="rlserve-engine-watch", daemon=True).start()
        self._reader = asyncio.ensure_future(self._read(output, decoder))
        return message

    def _watch_process(self, proc: subprocess.Popen, loop: asyncio.AbstractEventLoop) -> None:
        code = proc.wait()
        loop.call_soon_threadsafe(self._process_exited, proc.pid, code)

    def _watch_pid(self, loop: asyncio.AbstractEventLoop, pid: int) -> None:
        while not self.closing:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                loop.call_soon_threadsafe(self._die, f"the engine process (pid {pid}) is gone")
                return
            time.sleep(0.5)

    def _process_exited(self, pid: int, code: int) -> None:
        self._exited.set()
        if self.closing:
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        self._die(f"the engine process (pid {pid}) {how}")

    async def _read(self, sock: zmq.asyncio.Socket, decoder: msgspec.msgpack.Decoder) -> None:
        while True:
            frame = await sock.recv(copy=False)
            message = decoder.decode(frame.buffer)
            if isinstance(message, EngineCoreOutputs):
                self.on_outputs(message)
            elif isinstance(message, CallResult):
                fut = self._calls.pop(message.call_id, None)
                if fut is not None and not fut.done():
                    if message.ok:
                        fut.set_result(message.value)
                    else:
                        fut.set_exception(error_from_result(message))
            elif isinstance(message, EngineDead):
                self._die(message.reason)

    def _die(self, reason: str) -> None:
        """The engine is gone: fail every call, tell the owner once."""
        if self.dead is not None:
            return
        self.dead = reason
        logger.error("the engine is down: %s", reason)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._calls.clear()
        if self.on_dead is not None:
            self.on_dead(reason)

    # -- requests and calls ------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is down: {self.dead}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    stream: bool, cache_salt: str | None = None, lora_name: str | None = None) -> None:
        self._check_alive()
        self._input.send(self._encode(AddRequest(request_id, prompt_token_ids, params, stream,
                                                 self.client_index, cache_salt, lora_name)), copy=False)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            self._input.send(self._encode(AbortRequests(request_ids)), copy=False)

    async def call(self, body: AnyControlCall) -> Any:
        """Run a control call (messages.py: one struct per call) in the engine, between two
        steps or beside them for the calls that wait on a trainer; return its answer, as the
        call's reply struct (wire/control.py)."""
        self._check_alive()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._input.send(self._encode(Call(call_id, body, self.client_index)), copy=False)
        return msgspec.convert(await fut, reply_type(body))

    # -- stop --------------------------------------------------------------------------
    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine (if this client started it) and close the sockets."""
        self.closing = True
        if self.proc is not None and self.proc.poll() is None:
            try:
                await asyncio.wait_for(self.call(Shutdown()), 5)
            except (TimeoutError, Exception):
                self.proc.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
            except TimeoutError:
                logger.warning("the engine did not stop within %.0f s: killing it", timeout_s)
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.cancel()
        if self._output is not None:  # made by the asyncio context: not closed by destroy
            self._output.close(linger=0)
        self.ctx.destroy(linger=0)
        if self.proc is not None:
            self._remove_sockets()

    def _remove_sockets(self) -> None:
        paths = [a.removeprefix("ipc://") for a in [self.addresses.input, *self.addresses.outputs]]
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(os.path.dirname(paths[0]))
        except OSError:
            pass
