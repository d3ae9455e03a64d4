"""Pause modes compose, and sleep is honest: every /pause answers once its condition holds,
whatever state it starts from, and after a level-2 sleep nothing is generated from dropped
weights. A two-layer dummy model (helpers.servers.start_tiny_server) keeps the servers quick."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from helpers.servers import start_tiny_server, stop_server
from helpers.waiting import wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_tiny_server(tmp_path_factory.mktemp("pause") / "s.log",
                            "--weight-transfer-config", '{"backend": "gloo", "timeout_s": 30}',
                            "--max-model-len", "4096")
    yield srv
    stop_server(srv)


def _long_request(url: str, out: dict, key: str, max_tokens: int = 4000) -> threading.Thread:
    def run() -> None:
        out[key] = httpx.post(f"{url}/v1/completions", timeout=300, json=dict(
            model="m", prompt=[1, 2, 3], max_tokens=max_tokens, ignore_eos=True, temperature=0))
    t = threading.Thread(target=run)
    t.start()
    return t


def _post(url: str, path: str, **params) -> httpx.Response:
    return httpx.post(f"{url}{path}", params=params, timeout=120)


def _wait_running(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        if any(line.startswith("vllm:num_requests_running{") and float(line.split()[1]) >= 1
               for line in text.splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError("the request never started")


def test_pause_wait_after_pause_keep_is_refused_at_once_and_the_keep_holds(server):
    """Waiting would first resume what the keep-pause froze, and last as long as the
    requests run: a 409 at once saying so, and the frozen requests stay frozen."""
    out = {}
    t = _long_request(server.url, out, "r", max_tokens=400)
    _wait_running(server.url)
    assert _post(server.url, "/pause", mode="keep").json() == {"status": "paused", "mode": "keep"}
    t0 = time.monotonic()
    r = _post(server.url, "/pause", mode="wait")
    assert time.monotonic() - t0 < 5
    assert r.status_code == 409, r.text
    assert "mode keep" in r.json()["error"]["message"] and "/resume" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": True}
    assert t.is_alive()  # still frozen
    assert _post(server.url, "/resume").status_code == 200
    assert _post(server.url, "/pause", mode="wait").json()["mode"] == "wait"  # drains them now
    t.join(timeout=60)
    assert out["r"].json()["choices"][0]["finish_reason"] == "length"
    assert _post(server.url, "/resume").status_code == 200


def test_pause_wait_while_asleep_answers_that_the_requests_are_kept(server):
    out = {}
    t = _long_request(server.url, out, "r", max_tokens=300)
    _wait_running(server.url)
    assert _post(server.url, "/sleep", level=1).status_code == 200
    r = _post(server.url, "/pause", mode="wait")
    assert r.status_code == 200 and r.json() == {"status": "paused", "mode": "keep", "kept": 1}
    assert _post(server.url, "/wake_up").status_code == 200
    assert _post(server.url, "/resume").status_code == 200
    t.join(timeout=300)
    assert out["r"].json()["choices"][0]["finish_reason"] == "length"


def test_resume_during_pause_wait_answers_409(server):
    out, answer = {}, {}
    t = _long_request(server.url, out, "r")
    _wait_running(server.url)
    waiter = threading.Thread(target=lambda: answer.setdefault("r", _post(server.url, "/pause", mode="wait")))
    waiter.start()
    # The pause is in place at once; the call then waits for the long request.
    wait_until(lambda: httpx.get(f"{server.url}/is_paused").json()["is_paused"], 60, "the pause reaches the engine")
    assert _post(server.url, "/resume").status_code == 200
    waiter.join(timeout=60)
    r = answer["r"]
    assert r.status_code == 409 and "resumed" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": False}
    assert _post(server.url, "/pause", mode="abort").status_code == 200  # the long request ends
    assert _post(server.url, "/resume").status_code == 200
    t.join(timeout=60)
    assert out["r"].json()["choices"][0]["finish_reason"] == "abort"


def test_after_a_level_2_sleep_generation_waits_for_a_full_update(server):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlserve.model.presets import model_dir
    from rlserve.weight_transfer import WeightSyncClient
    assert _post(server.url, "/sleep", level=2).status_code == 200
    assert _post(server.url, "/wake_up").status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", timeout=30, json=dict(model="m", prompt="Hi", max_tokens=2))
    assert r.status_code == 503 and "full weight update" in r.json()["error"]["message"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir("tiny")))
    client = WeightSyncClient(server.url, backend="gloo")
    client.init()
    named = list(model.named_parameters())
    # Part of the weights is refused, naming what is missing; nothing is generated yet.
    with pytest.raises(Exception, match="missing"):
        client.push(named[:3])
    assert httpx.post(f"{server.url}/v1/completions", timeout=30,
                      json=dict(model="m", prompt="Hi", max_tokens=2)).status_code == 503
    client.init()
    client.push(named)
    r = httpx.post(f"{server.url}/v1/completions", timeout=30, json=dict(model="m", prompt="Hi", max_tokens=2))
    assert r.status_code == 200, r.text
