"""The engine-core process: the step loop, fed by API servers over ZeroMQ.

    python -m rlserve.engine.core_proc --input ADDR --output ADDR [--output ADDR ...]
    (the EngineConfig arrives as msgpack on stdin)

The API server (server/) parses HTTP, tokenizes and detokenizes; this process only
schedules and steps, so none of that front-end work takes the GIL from the loop that
feeds the device. The loop (`EngineCoreProc.run`) reads whatever messages have arrived,
takes one engine step, and hands the step's outputs to a sender thread, which encodes
them and sends one message per step to each API server.

Control calls run between two steps, so none ever sees a half-applied change. The parts
that wait on a trainer (joining its group, receiving an update) run on a thread of their
own while steps go on; the received update is then applied between two steps (the thread
hands it back to the loop as a message on the loop's own input), and only then answered.

Lifecycle: the process takes its orders from the API server that started it. SIGINT and
SIGTERM are ignored (Ctrl-C or `kill -TERM -PGID` reach the whole process group; the API
server lets requests finish or aborts them, then sends `shutdown`, which stops the loop,
the tensor-parallel workers and the process, exit 0). If the API server dies, this process
is killed with it (see process.py). An error in the loop is fatal: every API server is
told why (EngineDead) and the process exits 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import msgspec
import zmq

from rlserve.engine.core import EngineCore
from rlserve.engine.messages import (AbortRequests, AddRequest, CallResult, ConflictError, EngineDead,
                                     EngineInput, EngineReady, ModelNotFoundError, UtilityCall,
                                     error_result)
from rlserve.engine.outputs import EngineCoreOutputs, Rejected
from rlserve.engine.request import EngineUnavailableError
from rlserve.process import profiled, watch_parent
from rlserve.sampling_params import InvalidRequestError
from rlserve.weight_transfer.address import get_ip

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100  # an idle loop still looks at its workers' health this often
_GRAMMAR_POLL_MS = 2  # how soon a compiled grammar's request starts


class EngineCoreProc:
    def __init__(self, input_address: str, output_addresses: list[str]):
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.bind(input_address)
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.num_clients = len(output_addresses)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._send_loop, args=(output_addresses,),
                                       name="rlserve-engine-sender", daemon=True)
        self.sender.start()
        self.core: EngineCore | None = None
        self.owners: dict[str, int] = {}  # sample id -> API server, with several of them
        self.waits: list[UtilityCall] = []  # pause(wait) calls, answered once they hold
        self.input_address = input_address
        self.transfer: UtilityCall | None = None  # the weight-transfer call under way, if any
        self.stopping = False

    # -- output ------------------------------------------------------------------------
    def _send_loop(self, addresses: list[str]) -> None:
        sockets = []
        for address in addresses:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the API server keeps up
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(address)
            sockets.append(sock)
        encode = msgspec.msgpack.Encoder().encode
        while True:
            item = self.outbox.get()
            if item is None:
                break
            client, message = item
            if client is None:
                for sock in sockets:
                    sock.send(encode(message), copy=False)
            else:
                sockets[client].send(encode(message), copy=False)
        for sock in sockets:
            sock.close()

    def _send(self, client: int | None, message: Any) -> None:
        self.outbox.put((client, message))

    def _emit(self, out: EngineCoreOutputs) -> None:
        if self.num_clients == 1:
            self._send(0, out)
            return
        for client, part in self._split(out).items():
            self._send(client, part)

    def _split(self, out: EngineCoreOutputs) -> dict[int, EngineCoreOutputs]:
        """One step's outputs, per API server (by the owner of each sample)."""
        owners = self.owners
        parts: dict[int, EngineCoreOutputs] = {}

        def part(rid: str) -> EngineCoreOutputs:
            client = owners.get(rid, 0)
            p = parts.get(client)
            if p is None:
                p = parts[client] = EngineCoreOutputs(out.version, [], [], [] if out.logprobs is not None else None)
            return p

        for i, (rid, token) in enumerate(zip(out.request_ids, out.token_ids)):
            p = part(rid)
            p.request_ids.append(rid)
            p.token_ids.append(token)
            if p.logprobs is not None:
                p.logprobs.append(out.logprobs[i])
        for st in out.started:
            part(st.request_id).started.append(st)
        for f in out.finished:
            part(f.request_id).finished.append(f)
            owners.pop(f.request_id, None)
        return parts

    def _reply(self, call: UtilityCall, value: Any = None) -> None:
        self._send(call.client, CallResult(call.call_id, True, value))

    def _fail_call(self, call: UtilityCall, e: BaseException) -> None:
        self._send(call.client, error_result(call.call_id, e))

    # -- the loop ----------------------------------------------------------------------
    def start(self, core_factory: Callable[[], EngineCore]) -> None:
        """Build the engine and tell every API server it is ready."""
        core = self.core = core_factory()
        self._send(None, EngineReady(
            max_model_len=core.max_model_len, vocab_size=core.vocab_size,
            world_size=core.world_size, eos_token_ids=sorted(core.eos_token_ids),
            weight_version=core.weight_version, kv_capacity_tokens=core.kv.capacity_tokens,
            model_type=type(core.executor.driver.model).__name__, device=str(core.device),
            dtype=str(core.executor.driver.dtype).removeprefix("torch."),
            load_seconds=core.load_seconds, pid=os.getpid(), host=get_ip()))

    def run(self) -> None:
        core = self.core
        assert core is not None
        while not self.stopping:
            self._read_inputs(block=not core.has_work(),
                              timeout_ms=_GRAMMAR_POLL_MS if core.compiling else _IDLE_POLL_MS)
            if core.has_work() or core.compiling:
                out = core.step()
                if out is not None:
                    self._emit(out)
            else:  # nothing steps, so nothing would notice a lost rank
                core.executor.check_health()
            if self.waits:
                self._check_waits()

    def _read_inputs(self, block: bool, timeout_ms: int = _IDLE_POLL_MS) -> None:
        sock = self.input
        if block and not sock.poll(timeout_ms):
            return
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = self.decoder.decode(frame.buffer)
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequests):
                self._abort(message.request_ids)
            elif isinstance(message, UtilityCall):
                self._call(message)
            else:  # the typed adapter calls
                self._call(message.as_call())

    def _add(self, m: AddRequest) -> None:
        core = self.core
        try:
            reqs = core.make_requests(m.prompt_token_ids, m.params, m.request_id, m.stream, m.cache_salt,
                                      m.lora_name)
            for req in reqs:
                core.add_request(req)
        except (InvalidRequestError, EngineUnavailableError) as e:
            status = (503 if isinstance(e, EngineUnavailableError) else
                      404 if isinstance(e, ModelNotFoundError) else 400)
            self._send(m.client, EngineCoreOutputs(core.weight_version, rejected=[
                Rejected(m.request_id, str(e), getattr(e, "param", None), status)]))
            return
        if self.num_clients > 1:
            for req in reqs:
                self.owners[req.request_id] = m.client

    def _abort(self, request_ids: list[str]) -> None:
        finished = self.core.abort(request_ids)
        if finished:
            self._emit(EngineCoreOutputs(self.core.weight_version, finished=finished))

    # -- control calls ------------------------------------------------------------------
    def _call(self, call: UtilityCall) -> None:
        handler = getattr(self, f"_call_{call.method}", None)
        try:
            if handler is None:
                raise InvalidRequestError(f"method: the engine has no call {call.method!r}", "method")
            value = handler(call, *call.args)
        except Exception as e:
            self._fail_call(call, e)
            return
        if value is not _DEFERRED:
            self._reply(call, value)

    # Joining a trainer's group and receiving an update wait on the trainer: a thread of
    # their own does that while the loop steps on. A new init replaces whatever transfer is
    # under way (the trainer started over: the pending init or receive fails at once); an
    # update while another transfer is under way is a 409.
    def _call_init_weight_transfer(self, call: UtilityCall, backend: str, init_info: dict,
                                   timeout_s: float):
        if self.transfer is not None and self.core.world_size == 1:
            self.core.executor.driver.abort_weight_transfer(
                "replaced by a newer /init_weight_transfer_engine")
        self.transfer = call

        def run() -> None:
            try:
                self.core.executor.collective_rpc("init_weight_transfer", backend, init_info, timeout_s)
            except Exception as e:
                self._fail_call(call, e)
            else:
                self._reply(call)
            finally:
                if self.transfer is call:
                    self.transfer = None

        threading.Thread(target=run, name="rlserve-init-transfer", daemon=True).start()
        return _DEFERRED

    def _call_update_weights(self, call: UtilityCall, update_info: dict, version):
        if self.transfer is not None:
            raise ConflictError(f"update_weights: {self.transfer.method} is still under way; "
                                "send /update_weights once it has answered")
        refusal = None
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            refusal = InvalidRequestError(
                f"update_info.weight_version: must be an integer, got {version!r}", "weight_version")
        elif self.core.sleeping:
            refusal = InvalidRequestError(
                "the server is asleep: POST /wake_up before updating weights", "update_info")
        lora = None  # an adapter's update: (name, its config for the workers)
        if refusal is None and isinstance(update_info, dict) and update_info.get("lora_name") is not None:
            try:
                lora = [update_info["lora_name"], self.core.require_lora().update_config(update_info)]
            except InvalidRequestError as e:
                refusal = e
        self.transfer = call
        transfer = self.core.config.weight_transfer
        if refusal is None and transfer is not None and transfer.backend == "ipc":
            # An IPC receive opens handles to the trainer's memory and waits on nobody: done
            # here, between two steps, it saves a thread and a message on every push.
            self._receive(call, update_info, version, lora, inline=True)
            return _DEFERRED
        threading.Thread(target=self._receive if refusal is None else self._refuse,
                         args=(call, update_info, version, lora) if refusal is None else
                         (call, update_info, refusal),
                         name="rlserve-receive-update", daemon=True).start()
        return _DEFERRED

    def _refuse(self, call: UtilityCall, update_info: dict, refusal: InvalidRequestError) -> None:
        """Refused before any byte moved: a trainer sending it hears so at once (its
        trainer_send_weights raises the same message), and the group stays in step."""
        try:
            self.core.executor.collective_rpc("refuse_update", update_info, str(refusal))
        finally:
            if self.transfer is call:
                self.transfer = None
            self._fail_call(call, refusal)

    def _receive(self, call: UtilityCall, update_info: dict, version: int | None,
                 lora: list | None = None, inline: bool = False) -> None:
        """Receive into staging, then apply between two steps: at once when `inline` (this
        is the loop's thread), else through the loop's input like any other message."""
        t0 = time.perf_counter()
        try:
            extra = () if lora is None else (lora[1],)
            sizes = self.core.executor.collective_rpc("receive_weights", update_info, *extra)
        except Exception as e:
            if self.transfer is call:
                self.transfer = None
            try:
                self.core.executor.collective_rpc("drop_staged_weights")
            finally:
                self._fail_call(call, e)
            return
        apply = UtilityCall(call.call_id, "apply_update",
                            [version, sizes[0], time.perf_counter() - t0, lora], call.client)
        if inline:
            self._call(apply)
            return
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(self.input_address)
        sock.send(msgspec.msgpack.encode(apply))
        sock.close(linger=-1)

    def _call_apply_update(self, call: UtilityCall, version: int | None, num_bytes: int,
                           receive_seconds: float, lora: list | None = None) -> dict:
        t0 = time.perf_counter()
        try:
            new_version = self.core.apply_staged_weights(version, None if lora is None else tuple(lora))
        finally:
            t = self.transfer  # this update's (a newer init may have taken over meanwhile)
            if t is not None and (t.call_id, t.client, t.method) == (call.call_id, call.client, "update_weights"):
                self.transfer = None
        return {"weight_version": new_version, "num_bytes": num_bytes,
                "receive_seconds": receive_seconds, "apply_seconds": time.perf_counter() - t0}

    def _call_pause(self, call: UtilityCall, mode: str = "abort", clear_cache: bool = False):
        finished = self.core.pause(mode, clear_cache)
        if finished:
            self._emit(EngineCoreOutputs(self.core.weight_version, finished=finished))
        if mode != "wait":
            return {"mode": mode}
        self.waits.append(call)
        self._check_waits()
        return _DEFERRED

    def _check_waits(self) -> None:
        """Answer pause(wait) calls whose condition holds: the requests in flight have
        finished, or can no longer run (a later keep-pause, or sleep: then they are kept,
        and the answer says so), or generation was resumed meanwhile (an error)."""
        core = self.core
        for call in list(self.waits):
            if not core.paused:
                self._fail_call(call, ConflictError(
                    "mode: generation was resumed before the requests in flight finished"))
            elif core.drained:
                self._reply(call, {"mode": "wait"})
            elif core.pause_mode == "keep" or core.sleeping:
                self._reply(call, {"mode": "keep", "kept": core.scheduler.num_unfinished})
            else:
                continue
            self.waits.remove(call)

    def _call_resume(self, call: UtilityCall) -> None:
        self.core.resume()

    def _call_sleep(self, call: UtilityCall, level: int = 1) -> None:
        out = self.core.sleep(level)
        if out is not None:
            self._emit(out)

    def _call_wake_up(self, call: UtilityCall) -> None:
        self.core.wake_up()

    def _call_reset_prefix_cache(self, call: UtilityCall) -> None:
        self.core.reset_prefix_cache()

    # A data-parallel replica that (re)joins copies a healthy replica's weights (and then
    # takes its version): the source sends between two of its steps, so the copy is one
    # version, never half of an update (updates are applied between steps too).
    def _call_weights_layout(self, call: UtilityCall) -> list[str]:
        return self.core.executor.collective_rpc("weights_layout")

    def _call_copy_weights_to_peer(self, call: UtilityCall, address: str, ports: list[int],
                                   digests: list[str], timeout_s: float) -> dict:
        if self.core.sleeping:
            raise ConflictError("copy_weights_to_peer: this replica is asleep")
        self._check_layouts(digests)
        version = self.core.weight_version
        sizes = self._per_rank("copy_weights_to_peer", address, ports, digests, timeout_s)
        return {"weight_version": version, "num_bytes": sum(sizes)}

    def _call_copy_weights_from_peer(self, call: UtilityCall, address: str, ports: list[int],
                                     digests: list[str], timeout_s: float, version: int) -> dict:
        self._check_layouts(digests)
        sizes = self._per_rank("copy_weights_from_peer", address, ports, digests, timeout_s)
        self.core.scheduler.no_weights = False
        self.core._new_version(version)
        return {"weight_version": version, "num_bytes": sum(sizes)}

    def _check_layouts(self, digests: list[str]) -> None:
        mine = self.core.executor.collective_rpc("weights_layout")
        if mine != list(digests):
            raise InvalidRequestError(f"peer weight copy: parameter layouts differ ({mine} here, "
                                      f"{list(digests)} at the source)", "replica")

    def _per_rank(self, method: str, address: str, ports: list[int], digests: list[str],
                  timeout_s: float) -> list[int]:
        # The layouts were compared above, rank by rank; every rank pair then copies at once.
        return [int(x) for x in self.core.executor.collective_rpc(method, address, ports, None, timeout_s)]

    def _call_load_lora(self, call: UtilityCall, name: str, path: str, load_inplace: bool = False) -> dict:
        return self.core.load_lora_adapter(name, path, load_inplace)

    def _call_unload_lora(self, call: UtilityCall, name: str) -> None:
        self.core.unload_lora_adapter(name)

    def _call_list_loras(self, call: UtilityCall) -> list:
        return self.core.list_lora_adapters()

    def _call_stats(self, call: UtilityCall):
        return self.core.stats()

    def _call_abort_all(self, call: UtilityCall) -> int:
        ids = self.core.unfinished_ids()
        self._abort(ids)
        return len(ids)

    def _call_shutdown(self, call: UtilityCall) -> None:
        self.stopping = True

    # -- end ---------------------------------------------------------------------------
    def die(self, reason: str) -> None:
        self._send(None, EngineDead(reason))

    def close(self) -> None:
        self.outbox.put(None)
        self.sender.join(timeout=5)
        self.input.close(linger=0)
        self.ctx.term()


_DEFERRED = object()  # a call answered later (pause with mode wait)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the rlserve engine-core process")
    parser.add_argument("--input", required=True, help="ZeroMQ address to bind for requests")
    parser.add_argument("--output", action="append", required=True,
                        help="ZeroMQ address of an API server's output socket (one per server)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
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
    with profiled(os.environ.get("RLSERVE_ENGINE_PROFILE")):
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
