"""A real `rlserve serve` process on a free port, as the tests start and stop it, and a
streamed completion read chunk by chunk."""

from __future__ import annotations

import json
import re
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
        super().__init__(model, *flags, log=log, timeout_s=timeout_s, die_with_parent=True, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, timeout_s: float = 30.0) -> None:
        super().stop(timeout_s)
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


def stop_server(server: RunningServer) -> None:
    server.stop(timeout_s=20)


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
