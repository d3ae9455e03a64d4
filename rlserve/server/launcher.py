"""`rlserve serve` in a child process: started, waited for, stopped. For examples,
benchmarks and trainers that bring their own rollout server.

    with ServerProcess(model, "--load-format", "dummy", "--device", "cpu") as server:
        requests.get(f"{server.url}/health")
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import requests

from rlserve.process import spawn
from rlserve.weight_transfer.group import get_open_port


class ServerProcess:
    """`die_with_parent`: the server ends with this process even when it is killed without
    running its cleanup (test suites, notebooks)."""

    def __init__(self, model: str, *flags: str, host: str = "127.0.0.1", port: int | None = None,
                 log: str | Path | None = None, timeout_s: float = 300.0, die_with_parent: bool = False,
                 env: dict[str, str] | None = None):
        self.model = model
        self.port = port or get_open_port()
        self.url = f"http://{host}:{self.port}"
        self.log = Path(log) if log is not None else None
        # Its own process group: stopping it ends everything it started.
        self.process = spawn("rlserve.cli", "serve", model, "--host", host, "--port", str(self.port), *flags,
                             new_session=True, log=self.log, env=env,
                             parent_death=signal.SIGTERM if die_with_parent else None)
        try:
            self._wait_healthy(timeout_s)
        except BaseException:  # Ctrl-C while it starts too: no server left behind
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}{self._log_hint()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).ok:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s:.0f} s{self._log_hint()}")

    def _log_hint(self) -> str:
        return f":\n{self.log_tail()}" if self.log is not None else ""

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log (empty without a log file)."""
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
