"""The server's processes: the API server, the engine-core process it starts, and the
engine's tensor-parallel workers. Whatever ends one of them, none is left behind, every
request in flight gets an answer, and the exit says what happened.

These run a two-layer dummy model (the `tiny` preset) with the demo model's tokenizer, so
a server starts in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers.servers import start_tiny_server, stop_server
from rlserve.model.presets import model_dir


def _descendants(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(k) for k in (task / "children").read_text().split()]
    except FileNotFoundError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _stream(url: str, max_tokens: int = 900):
    body = dict(model="m", prompt=[1, 2, 3, 4], max_tokens=max_tokens, ignore_eos=True, stream=True,
                temperature=0)
    return httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120)


def _events(lines) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in lines if line.startswith("data: ")]


def test_engine_and_workers_exit_when_the_api_server_is_killed(tmp_path):
    srv = start_tiny_server(tmp_path / "s.log", "--tensor-parallel-size", "2")
    try:
        below = _descendants(srv.process.pid)
        assert len(below) == 2  # the engine process and its rank-1 worker
        os.kill(srv.process.pid, signal.SIGKILL)
        assert _wait_gone(below, 20) == []
    finally:
        stop_server(srv)


def test_engine_death_fails_requests_then_the_server_exits(tmp_path):
    srv = start_tiny_server(tmp_path / "s.log", "--engine-death-linger", "3")
    try:
        (engine,) = _descendants(srv.process.pid)
        lines = []
        with _stream(srv.url) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    os.kill(engine, signal.SIGKILL)
        events = _events(lines)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == 503 and "engine" in error["message"], error
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 503 and "killed by signal 9" in health.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/completions", json=dict(model="m", prompt="Hi", max_tokens=2), timeout=10)
        assert r.status_code == 503
        assert srv.process.wait(timeout=30) == 1
    finally:
        stop_server(srv)


def test_a_killed_api_server_stops_the_whole_server(tmp_path):
    """With --api-server-count 2, a dead API server would leave its share of connections
    unanswered while /health (answered by the other) says 200: the server exits 1 instead."""
    srv = start_tiny_server(tmp_path / "s.log", "--api-server-count", "2")
    try:
        kids = _descendants(srv.process.pid)
        api = [p for p in kids if "rlserve.server.lifecycle" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(api) == 1, kids
        os.kill(api[0], signal.SIGKILL)
        assert srv.process.wait(timeout=60) == 1
        assert "API server 1 (pid" in (tmp_path / "s.log").read_text()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{srv.url}/health", timeout=5)
        assert _wait_gone(kids, 30) == []
    finally:
        stop_server(srv)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_streams_with_abort_after_the_grace_period(tmp_path, sig):
    """Ctrl-C reaches the whole process group, as does `kill -TERM -PGID`: workers and the
    engine leave the shutdown to the API server, which lets requests run for the grace
    period, aborts them, and exits 0, saying nothing is wrong."""
    log = tmp_path / "s.log"
    srv = start_tiny_server(log, "--tensor-parallel-size", "2", "--shutdown-grace-period", "1",
                      "--max-model-len", "8192")
    try:
        below = _descendants(srv.process.pid)
        lines = []
        with _stream(srv.url, max_tokens=8000) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    sent = time.monotonic()
                    os.killpg(srv.process.pid, sig)
        ended = time.monotonic() - sent
        events = _events(lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        assert ended < 10
        assert srv.process.wait(timeout=30) == 0
        assert _wait_gone(below, 10) == []
        text = log.read_text()
        assert "ERROR" not in text and "Traceback" not in text, text[-3000:]
    finally:
        stop_server(srv)


def test_a_port_in_use_is_reported_before_the_model_loads(demo_model):
    tiny = model_dir("tiny")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "rlserve.cli", "serve", tiny, "--load-format", "dummy",
                               "--tokenizer", demo_model, "--host", "127.0.0.1", "--port", str(port),
                               "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "loading" not in proc.stderr  # refused before anything was loaded
    assert time.monotonic() - t < 60


def test_request_limits_answer_400_and_413_and_the_server_keeps_serving(tmp_path):
    srv = start_tiny_server(tmp_path / "s.log", "--max-request-body-bytes", "20000",
                            "--max-prompts-per-request", "4")
    try:
        url = f"{srv.url}/v1/completions"
        r = httpx.post(url, json=dict(model="m", prompt="word " * 10000, max_tokens=2), timeout=30)
        assert r.status_code == 413 and "20000" in r.json()["error"]["message"]
        # No length announced: the limit holds as the bytes arrive.
        chunks = (b'{"model": "m", "prompt": "' + b"x" * 1000 for _ in range(30))
        r = httpx.post(url, content=chunks, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413
        r = httpx.post(url, json=dict(model="m", prompt=["Hi"] * 5, max_tokens=2), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "4" in r.json()["error"]["message"]
        r = httpx.post(url, json=dict(model="m", prompt=["Hi"] * 4, max_tokens=2), timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
    finally:
        stop_server(srv)
