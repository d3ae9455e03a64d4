"""One data-parallel replica as a Ray actor: it starts an engine-core process on its node
(core_proc.py, the process `rlserve serve` starts locally), reachable over TCP, whose
messages go to the router's front end. The actor watches the process: if it dies, the
actor tells the router at once (an EngineDead message on the router's socket), so the
router takes the replica out of rotation without waiting on a timeout.
"""

from __future__ import annotations

import signal
import subprocess
import threading

import msgpack
import msgspec
import zmq

from rlserve.process import spawn
from rlserve.weight_transfer.address import get_ip, get_open_port
from rlserve.wire.messages import EngineDead


class EngineReplica:
    """Made a Ray actor by cluster.py (this module does not import ray)."""

    def __init__(self, index: int, config: dict, log_level: str = "info"):
        self.index = index
        self.config = config
        self.log_level = log_level
        self.proc: subprocess.Popen | None = None
        self.stopping = False
        self.gpu_ids: list[str] = []

    def set_gpus(self, gpu_ids: list[str]) -> None:
        """The GPUs of this replica's bundles (its own and its tensor-parallel peers')."""
        self.gpu_ids = [str(g) for g in gpu_ids]

    def own_gpus(self) -> list[str]:
        import ray
        return [str(g) for g in ray.get_gpu_ids()]

    def start(self, output_address: str) -> str:
        """Start the engine; returns the address it listens on (it loads meanwhile)."""
        self.stop()
        self.stopping = False
        address = f"tcp://{get_ip()}:{get_open_port()}"
        proc = spawn("rlserve.engine.core_proc", "--input", address, "--output", output_address,
                     "--log-level", self.log_level, stdin=msgpack.packb(self.config, use_bin_type=True),
                     parent_death=signal.SIGKILL, gpus=self.gpu_ids or None)
        self.proc = proc
        threading.Thread(target=self._watch, args=(proc, output_address), daemon=True).start()
        return address

    def _watch(self, proc: subprocess.Popen, output_address: str) -> None:
        code = proc.wait()
        if self.stopping or proc is not self.proc:
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(output_address)
        sock.send(msgspec.msgpack.encode(EngineDead(
            f"the engine process of replica {self.index} (pid {proc.pid}, host {get_ip()}) {how}")))
        sock.close()
        ctx.term()

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        self.stopping = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()  # the router has stopped sending; nothing to drain
            proc.wait()


class GPUHolder:
    """Holds one GPU bundle of a tensor-parallel replica and says which GPU it is."""

    def gpus(self) -> list[str]:
        import ray
        return [str(g) for g in ray.get_gpu_ids()]
