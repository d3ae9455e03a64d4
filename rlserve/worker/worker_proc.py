"""The process of one tensor-parallel rank other than 0:

    python -m rlserve.worker.worker_proc --fd N      (N: its end of a socket to the executor)

It joins the TP group, builds its Worker, then serves the executor's messages (see
channel.py) until told to stop or the executor goes away. Steps, and the calls that touch
the model or its cache, run in arrival order on the main thread, so they fall between two
steps exactly as on rank 0. A step runs as on rank 0 (its runner's launch, then collect): the
step before it stays in flight until the next one is queued, so the worker never waits
for its device between two steps, and a call first finishes the step in flight. The
calls that only wait on the trainer (calls.py: `background`) run on a helper thread, so
steps go on while bytes arrive, as they do on rank 0.
A step that fails is fatal: the worker reports it and exits, which fails the other ranks'
collectives instead of leaving them waiting.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from rlserve.process import watch_parent
from rlserve.worker.calls import AnyRankCall, AnyTensorCall, RankCall
from rlserve.worker.channel import Channel, ChannelClosed, StepDecoder, error_reply

if TYPE_CHECKING:
    from rlserve.worker.step_inputs import StepHandle
    from rlserve.worker.worker import Worker

logger = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """A call's result in msgpack's vocabulary."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return value


def _start(init: dict[str, Any]) -> Worker:
    from rlserve.config import EngineConfig
    from rlserve.distributed import TPGroup, tp_device
    from rlserve.model.loader import load_hf_config
    from rlserve.worker.worker import Worker

    config = EngineConfig(**init["config"])
    rank, world_size = init["rank"], init["world_size"]
    device = tp_device(config.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    elif init.get("num_threads"):
        torch.set_num_threads(init["num_threads"])
    tp = TPGroup.join(rank, world_size, device, init["tp_port"], timeout_s=init["timeout_s"])
    hf_config = load_hf_config(init["model_path"], config.trust_remote_code, config.hf_overrides)
    return Worker(config, hf_config, init["model_path"], rank=rank, tp=tp)


class WorkerLoop:
    def __init__(self, worker: Worker, chan: Channel) -> None:
        self.worker = worker
        self.chan = chan
        self.steps = StepDecoder()
        self.calls = msgspec.msgpack.Decoder(AnyRankCall)
        self.tensor_calls = msgspec.msgpack.Decoder(AnyTensorCall)
        self.background: threading.Thread | None = None
        self.inflight: StepHandle | None = None  # the last step queued, not yet collected

    def run(self) -> int:
        while True:
            try:
                msg = self.chan.recv()
            except ChannelClosed:
                return 0  # the engine went away: nothing left to serve
            op = msg["op"]
            if op == "step":
                try:
                    self._step(msg)
                except Exception:
                    return self._fatal("a step failed")
                continue
            try:
                self._finish_step()
            except Exception:
                return self._fatal("a step failed")
            if op == "call":
                self._call(self.calls.decode(msg["call"]))
            elif op == "load":
                try:
                    call = self.tensor_calls.decode(msg["call"])
                    tensors = self._receive_tensors(msg["tensors"])
                except Exception:
                    return self._fatal("receiving tensors from rank 0 failed")
                self._reply(functools.partial(call.run_with, self.worker, tensors), call)
            elif op == "shutdown":
                if self.background is not None:
                    self.background.join(timeout=5)
                return 0
            else:
                return self._fatal(f"unknown message {op!r}")

    def _step(self, msg: dict[str, Any]) -> None:
        """Queue this step (reading the tokens of the one in flight where it must), then
        wait for the one before it, as rank 0 does with overlapped scheduling."""
        sched, tables = self.steps.decode(msg)
        handle = self.worker.runner.launch(sched, tables, self.inflight)
        self._finish_step()
        self.inflight = handle

    def _finish_step(self) -> None:
        if self.inflight is not None:
            handle, self.inflight = self.inflight, None
            self.worker.runner.collect(handle)

    def _fatal(self, what: str) -> int:
        error = f"{what}:\n{traceback.format_exc()}"
        logger.error("rank %d: %s", self.worker.rank, error)
        try:
            self.chan.send({"op": "fatal", "error": error})
        except ChannelClosed:
            pass
        return 1

    def _call(self, call: RankCall) -> None:
        run = lambda: call.run(self.worker)  # noqa: E731
        if not call.background:
            self._reply(run, call)
            return
        if self.background is not None:
            self.background.join()  # the executor sends one call at a time; belt and braces
        self.background = threading.Thread(
            target=self._reply, args=(run, call), name=f"rlserve-{type(call).__name__}", daemon=True
        )
        self.background.start()

    def _reply(self, run: Callable[[], Any], call: RankCall) -> None:
        try:
            reply = {"op": "reply", "ok": True, "result": _plain(run())}
        except Exception as e:
            reply = error_reply(e)
        try:
            self.chan.send(reply)
        except TypeError as e:  # a result msgpack cannot carry: a bug, but answer anyway
            self.chan.send(error_reply(TypeError(f"{type(call).__name__} returned an unsendable result: {e}")))

    def _receive_tensors(self, metas: list[list[Any]]) -> list[tuple[str, torch.Tensor]]:
        """Tensors rank 0 broadcasts over the TP group, to load like a checkpoint."""
        from rlserve.weight_transfer.packing import DTYPES, as_bytes

        tensors = []
        for name, dtype, shape in metas:
            t = torch.empty(shape, dtype=DTYPES[dtype], device=self.worker.device)
            if t.numel():
                self.worker.tp.broadcast(as_bytes(t), src=0)
            tensors.append((name, t))
        return tensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank of an rlserve engine")
    parser.add_argument("--fd", type=int, required=True, help="socket to the executor")
    args = parser.parse_args(argv)
    # Ctrl-C and a SIGTERM to the process group reach us too: the engine process stops us
    # in order (a rank that just vanished would read as a crash). Its death ends us anyway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(os.getppid())
    chan = Channel(socket.socket(fileno=args.fd))
    try:
        init = chan.recv()
    except ChannelClosed:
        return 1
    rank = init["rank"]
    logging.basicConfig(
        level=init.get("log_level", logging.INFO),
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        worker = _start(init)
    except Exception as e:
        logger.exception("rank %d failed to start", rank)
        chan.send(error_reply(e))
        return 1
    chan.send({"op": "reply", "ok": True, "result": None})
    return WorkerLoop(worker, chan).run()


if __name__ == "__main__":
    sys.exit(main())
