"""A real `rlserve serve` process on a free port, as the tests start and stop it, and a
streamed completion read chunk by chunk."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from rlserve import envs
from rlserve.server.launcher import ServerProcess
from rlserve.weight_transfer.address import is_loopback

API_KEY = "test-key"
MAX_MODEL_LEN = 1024
SERVER_START_TIMEOUT_S = envs.RLSERVE_TEST_SERVER_TIMEOUT.get()


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, results: list,
                      progress: list, i: int, at: tuple[int, Callable[[], object]] | None = None) -> None:
    """One streamed greedy completion; `results[i]` = ([(token_ids, weight version) per
    chunk], finish reason, version spans); `progress[i]` counts tokens as they arrive.
    `at` = (n, action): the action runs once n tokens have arrived, before the next chunk is
    read, so it lands while the request still runs however fast the model is."""
    import httpx
    chunks, finish, spans = [], None, None
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                ignore_eos=True, return_token_ids=True, return_weight_versions=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            for c in data["choices"]:
                chunks.append((c.get("token_ids") or [], data["weight_version"]))
                progress[i] += len(chunks[-1][0])
                if at is not None and progress[i] >= at[0]:
                    at[1]()
                    at = None
                finish = c.get("finish_reason") or finish
                spans = c.get("weight_version_spans") or spans
    results[i] = (chunks, finish, spans)


class RunningServer(ServerProcess):
    """A test's server: the launcher's process, plus the API key the tests send."""

    def __init__(self, model: str, log: Path, *flags: str, api_key: str | None, timeout_s: float,
                 env: dict[str, str] | None = None):
        self.api_key = api_key
        devices = [value for flag, value in zip(flags, flags[1:]) if flag == "--device"]
        self.device = devices[-1] if devices else "auto"  # the last flag wins, as in argparse
        super().__init__(model, *flags, log=log, timeout_s=timeout_s, die_with_parent=True, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, timeout_s: float = 30.0) -> None:
        super().stop(timeout_s)
        self.assert_groups_on_loopback()

    def assert_groups_on_loopback(self) -> None:
        masters = groups_joined(self.log.read_text(errors="replace")) if self.log and self.log.exists() else []
        outside = [m for m in masters if not is_loopback(m.rpartition(":")[0])]
        # Tests talk over loopback only: a trainer's group at a host interface would not.
        assert not outside, f"the server joined weight-transfer groups off loopback: {outside}"


def groups_joined(log: str) -> list[str]:
    """HOST:PORT of every trainer group a server's log says it joined."""
    return re.findall(r"weight-transfer group at (\S+) as rank", log)


def start_server(model: str, log: Path, *extra: str, api_key: str | None = None,
                 timeout_s: float = SERVER_START_TIMEOUT_S, env: dict[str, str] | None = None) -> RunningServer:
    """`rlserve serve` on CPU in float32 (flags in `extra` override), healthy on return.
    `env`: variables added to the server's environment."""
    flags = ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), *extra]
    if api_key:
        flags += ["--api-key", api_key]
    return RunningServer(model, log, *flags, api_key=api_key, timeout_s=timeout_s, env=env)


def start_tiny_server(log: Path, *extra: str, **kw) -> RunningServer:
    """A two-layer dummy model with the demo model's tokenizer, served as "m": it starts in
    seconds, for tests of the server itself rather than of a model's outputs."""
    from rlserve.model.demo_model import demo_model_path
    from rlserve.model.presets import model_dir
    return start_server(model_dir("tiny"), log, "--load-format", "dummy", "--tokenizer",
                        demo_model_path(), "--served-model-name", "m", *extra, **kw)


def start_side_by_side(*starts: Callable[[], RunningServer]) -> list[RunningServer]:
    """Each `start` (a start_server call) at once, on threads: a start is mostly one process
    importing and loading at a time, so two take little longer than one on two cores. If one
    fails, those that started are stopped."""
    results: list[RunningServer | BaseException | None] = [None] * len(starts)
    ready = [threading.Event() for _ in starts]
    for i, start in enumerate(starts):
        threading.Thread(target=_start_and_hold, args=(start, results, i, ready[i]), daemon=True,
                         name=f"start-server-{i}").start()
    for event in ready:
        event.wait()
    started = [r for r in results if isinstance(r, RunningServer)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for srv in started:
            stop_server(srv)
        raise failed[0]
    return started


def _start_and_hold(start: Callable[[], RunningServer], results: list, i: int, ready: threading.Event) -> None:
    """Start a server, then live as long as its process: the death signal a server gets
    with its parent (PR_SET_PDEATHSIG) follows the thread that spawned it, not the process,
    so a starting thread that ended would stop its server."""
    try:
        results[i] = server = start()
    except BaseException as e:
        results[i] = e
        return
    finally:
        ready.set()
    try:
        os.waitid(os.P_PID, server.process.pid, os.WEXITED | os.WNOWAIT)  # leaves the reaping to Popen
    except ChildProcessError:
        pass  # reaped already


# Servers that stop_server left exiting on a thread, and what their logs said once they had.
_stopping: list[threading.Thread] = []
_found_after_exit: list[str] = []


def stop_server(server: RunningServer, wait: bool = False) -> None:
    """SIGTERM to the server's process group, and its exit awaited (SIGKILL after 20 s): for
    a CPU server on a thread unless `wait`, so that the seconds a shutdown takes (the engine's
    exit, then the API server's) overlap the tests that come next; wait_for_stopped() joins
    those threads. A GPU server's memory must be free before the next one sizes its cache."""
    server.assert_groups_on_loopback()  # the groups it joined while its tests ran
    if wait or server.device != "cpu":
        server.stop(timeout_s=20)
        return
    thread = threading.Thread(target=_stop, args=(server,), name=f"stop-server-{server.port}")
    thread.start()
    _stopping.append(thread)


def _stop(server: RunningServer) -> None:
    try:
        server.stop(timeout_s=20)
    except AssertionError as e:
        _found_after_exit.append(str(e))


def wait_for_stopped() -> None:
    """Every server stop_server left exiting has exited, and none joined a group off loopback."""
    while _stopping:
        _stopping.pop().join()
    found, _found_after_exit[:] = list(_found_after_exit), []
    assert not found, found


def start_push_target(checkpoint: str, log: Path, *extra: str, timeout_s: float = 30) -> RunningServer:
    """`checkpoint`'s architecture with dummy weights, served as "m" (512 tokens), for a gloo
    trainer to push its weights into (`timeout_s`: the transfer group's)."""
    return start_server(checkpoint, log, "--load-format", "dummy", "--served-model-name", "m",
                        "--max-model-len", "512", "--weight-transfer-config",
                        json.dumps({"backend": "gloo", "timeout_s": timeout_s}), *extra)


def served(url: str, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy token ids and their logprobs from model "m", one request per prompt: equal
    logprobs mean equal weights."""
    import httpx
    out = []
    for prompt in prompts:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
            model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
            logprobs=0, return_token_ids=True))
        r.raise_for_status()
        choice = r.json()["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out
