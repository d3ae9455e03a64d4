"""Shared fixtures: the demo model, and a real `rlserve serve` process on a free port."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

API_KEY = "test-key"
MAX_MODEL_LEN = 1024
SERVER_START_TIMEOUT_S = float(os.environ.get("RLSERVE_TEST_SERVER_TIMEOUT", "180"))


@pytest.fixture(scope="session")
def demo_model() -> str:
    from rlserve.model.demo_model import demo_model_path
    return demo_model_path()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


try:  # loaded here, not in the forked child, where loading a library is unsafe
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:
    _prctl = None


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the test process dies without its teardown."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    model: str  # the served model name
    api_key: str | None
    process: subprocess.Popen
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start_server(model: str, log: Path, *extra: str, api_key: str | None = None,
                 timeout_s: float = SERVER_START_TIMEOUT_S) -> RunningServer:
    """Start `python -m rlserve.cli serve` and wait until /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "rlserve.cli", "serve", model, "--device", "cpu",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), *extra]
    if api_key:
        cmd += ["--api-key", api_key]
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                            start_new_session=True)  # its own group: teardown ends all of it
    server = RunningServer(f"http://127.0.0.1:{port}", model, api_key, proc, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f}s:\n{server.log_tail()}")


def stop_server(server: RunningServer) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()


@pytest.fixture(scope="session")
def server(demo_model: str, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[RunningServer]:
    """One server for the whole session, with an API key (so 401s are testable too)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(demo_model, log, api_key=API_KEY)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def client(server: RunningServer):
    from openai import OpenAI
    return OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "EMPTY",
                  max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def offline_llm(demo_model: str):
    """The offline API on the same model: the reference the server must match."""
    from rlserve import LLM
    return LLM(demo_model, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
