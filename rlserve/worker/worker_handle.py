"""The executor's handle on one tensor-parallel worker process (worker_proc.py): its socket,
a reader thread that queues its replies and notices its loss, and how it exited.
"""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from rlserve.process import spawn
from rlserve.worker.channel import Channel, ChannelClosed


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "closed its connection"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class WorkerProcess:
    """The executor's handle on one worker process: its socket, its replies, its exit."""

    def __init__(self, rank: int, init: dict[str, Any], on_lost: Callable[[WorkerProcess], None]):
        self.rank = rank
        self.on_lost = on_lost
        ours, theirs = socket.socketpair()
        self.proc = spawn(
            "rlserve.worker.worker_proc",
            "--fd",
            str(theirs.fileno()),
            pass_fds=(theirs.fileno(),),
            parent_death=signal.SIGKILL,
        )  # it ignores SIGTERM
        theirs.close()
        self.chan = Channel(ours)
        self.replies: queue.Queue[dict | None] = queue.Queue()
        self.fatal: str | None = None
        self.chan.send(init)
        self._reader = threading.Thread(target=self._read, name=f"rlserve-rank{rank}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                msg = self.chan.recv()
                if msg.get("op") == "fatal":
                    self.fatal = msg.get("error")
                else:
                    self.replies.put(msg)
        except (ChannelClosed, msgpack.UnpackException, ValueError):
            pass
        self.on_lost(self)
        self.replies.put(None)  # wakes a caller waiting for a reply

    def describe_exit(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        what = f"tensor-parallel worker rank {self.rank} (pid {self.proc.pid}) {_describe_exit(code)}"
        if self.fatal:
            what += f": {self.fatal.strip().splitlines()[-1]}"
        return what

    def stop(self, timeout_s: float = 10.0) -> None:
        try:
            self.chan.send({"op": "shutdown"})
        except ChannelClosed:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.chan.close()
