"""Live weight updates against a real server process over gloo (vLLM's RLHF-over-HTTP flow on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from functools import partial

import httpx
import pytest
import torch

from helpers.oracle import greedy_reference
from helpers.servers import (
    groups_joined,
    start_server,
    start_side_by_side,
    start_tiny_server,
    stop_server,
    stream_completion,
)
from rlserve.weight_transfer import GlooWeightTransferEngine, WeightSyncClient, WeightTransferError, get_open_port

ADMIN_KEY = "admin-secret"
PROMPTS = ["The capital of France is", "Hello, my name is", "def fibonacci(n):"]
TRANSFER_TIMEOUT_S = 15


@pytest.fixture(scope="module")
def trainer_model(hf_demo):
    """The trainer's model: transformers on the real weights (pushes never change it)."""
    return hf_demo


@pytest.fixture(scope="module")
def reference(trainer_model, offline_llm):
    """transformers' greedy output on the real weights: what the server must produce."""
    return dict(zip(PROMPTS, greedy_reference(trainer_model, offline_llm, PROMPTS, 16)))


@pytest.fixture(scope="module")
def servers(demo_model, tmp_path_factory):
    """The module's two servers, started side by side: "dummy" (the demo model on dummy
    weights, for pushes) and "rejecting" (a small server whose weight transfer nobody
    initializes, refusing requests while asleep)."""
    logs = tmp_path_factory.mktemp("wt")
    cfg = json.dumps({"backend": "gloo", "timeout_s": TRANSFER_TIMEOUT_S})
    started = start_side_by_side(
        partial(start_server, demo_model, logs / "server.log", "--load-format", "dummy", "--weight-transfer-config",
                cfg, "--admin-key", ADMIN_KEY, "--served-model-name", "m", "--max-num-seqs", "32"),
        partial(start_tiny_server, logs / "rejecting.log", "--weight-transfer-config", '{"backend": "gloo"}',
                "--max-model-len", "64", "--reject-while-asleep"))
    yield dict(zip(("dummy", "rejecting"), started))
    for srv in started:
        stop_server(srv)


@pytest.fixture(scope="module")
def dummy_server(servers):
    return servers["dummy"]


def admin() -> dict:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


def greedy(url: str, prompt: str, max_tokens: int = 16) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, return_token_ids=True,
        ignore_eos=True))
    r.raise_for_status()
    return r.json()


def tokens(url: str, prompt: str) -> list[int]:
    return greedy(url, prompt)["choices"][0]["token_ids"]


def perturbed(model, scale: float):
    """The model's weights with a small, deterministic change (a 'training step')."""
    gen = torch.Generator().manual_seed(int(scale * 1000))
    return [(n, p.detach() + scale * torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()]


# -- vLLM's RLHF-over-HTTP flow, and the one-call client --------------------------------------------

def _scramble(url: str, model) -> None:
    """Replace every weight with seeded noise, through a group of its own."""
    client = WeightSyncClient(url, backend="gloo", admin_key=ADMIN_KEY)
    client.init()
    gen = torch.Generator().manual_seed(0)
    client.push([(n, 0.05 * torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()])


def test_vllm_rlhf_http_flow_makes_dummy_server_serve_the_real_model(dummy_server, trainer_model, reference):
    url = dummy_server.url
    if httpx.get(f"{url}/weight_version", headers=admin()).json()["weight_version"] != 0:
        # Another test pushed first: serve nonsense again, as the dummy weights did.
        _scramble(url, trainer_model)
    before = {p: tokens(url, p) for p in PROMPTS}
    assert all(before[p] != reference[p] for p in PROMPTS)  # dummy weights: nonsense
    v0 = httpx.get(f"{url}/weight_version", headers=admin()).json()["weight_version"]

    world_size = httpx.get(f"{url}/get_world_size", headers=admin()).json()["world_size"] + 1
    port = get_open_port()
    init = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=world_size)
    responses = {}
    t = threading.Thread(target=lambda: responses.setdefault("init", httpx.post(
        f"{url}/init_weight_transfer_engine", json={"init_info": init}, headers=admin(), timeout=60)))
    t.start()
    group = GlooWeightTransferEngine.trainer_init(dict(master_address="127.0.0.1", master_port=port,
                                                       world_size=world_size))
    t.join()
    assert responses["init"].status_code == 200, responses["init"].text

    assert httpx.post(f"{url}/pause", headers=admin()).status_code == 200
    assert httpx.get(f"{url}/is_paused", headers=admin()).json()["is_paused"] is True
    named = list(trainer_model.named_parameters())
    info = dict(names=[n for n, _ in named], dtype_names=[str(p.dtype).split(".")[-1] for _, p in named],
                shapes=[list(p.shape) for _, p in named], packed=True)
    t = threading.Thread(target=lambda: responses.setdefault("update", httpx.post(
        f"{url}/update_weights", json={"update_info": info}, headers=admin(), timeout=120)))
    t.start()
    GlooWeightTransferEngine.trainer_send_weights(iterator=trainer_model.named_parameters(),
                                                  group=group, packed=True)
    t.join()
    assert responses["update"].status_code == 200, responses["update"].text
    done = responses["update"].json()
    assert done["server_seconds"] >= done["receive_seconds"] + done["apply_seconds"] > 0  # where the time went
    assert httpx.post(f"{url}/resume", headers=admin()).status_code == 200

    after = greedy(url, PROMPTS[0])
    assert after["weight_version"] == v0 + 1
    for p in PROMPTS:
        assert tokens(url, p) == reference[p]


@pytest.fixture
def sync(dummy_server):
    """A group of the test's own: a test that forms a new group elsewhere cannot leave
    the next test holding a replaced one, whatever the order."""
    client = WeightSyncClient(dummy_server.url, backend="gloo", admin_key=ADMIN_KEY)
    client.init()
    return client


def test_the_client_forms_its_group_on_loopback_for_a_local_server(sync, dummy_server):
    """With no master_address, the group forms where the route to the server starts:
    loopback here, not the host's outbound interface (which get_ip() would give)."""
    joined = groups_joined(dummy_server.log.read_text())
    assert joined and joined[-1].startswith("127.0.0.1:"), joined


def _stream(url: str, prompt: str, results: list, progress: list, i: int, max_tokens: int = 48) -> None:
    stream_completion(url, "m", prompt, max_tokens, results, progress, i)


def _run_streams_with_push(url, sync, model, mode: str, version: int, n: int = 16):
    results: list = [None] * n
    progress = [0] * n
    threads = [threading.Thread(target=_stream, args=(url, PROMPTS[i % 3] + f" {i}", results, progress, i))
               for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.time() + 120
    while min(progress) < 4 and time.time() < deadline:  # every stream is under way
        time.sleep(0.05)
    assert min(progress) >= 4 and all(r is None for r in results)
    sync.push(perturbed(model, 0.0), version=version, pause_mode=mode)
    for t in threads:
        t.join(timeout=300)
    return results


def test_keep_mode_loses_nothing_and_spans_are_right(dummy_server, sync, trainer_model):
    v = 100
    results = _run_streams_with_push(dummy_server.url, sync, trainer_model, "keep", v)
    old = set()
    for chunks, finish, spans in results:
        assert finish == "length"
        toks = [t for ids, _ in chunks for t in ids]
        assert len(toks) == 48
        assert spans is not None and spans[0]["start"] == 0 and spans[-1]["end"] == 48
        assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
        assert spans[-1]["version"] == v
        old.update(s["version"] for s in spans[:-1])
        # Per-chunk versions agree with the spans.
        pos = 0
        for ids, version in chunks:
            for _ in ids:
                span = next(s for s in spans if s["start"] <= pos < s["end"])
                assert span["version"] == version
                pos += 1
    assert old and v not in old  # some tokens came from the previous weights


def test_abort_mode_ends_requests_with_abort(dummy_server, sync, trainer_model):
    results = _run_streams_with_push(dummy_server.url, sync, trainer_model, "abort", 200)
    assert all(finish == "abort" for _, finish, _ in results)
    assert all(len([t for ids, _ in c for t in ids]) < 48 for c, _, _ in results)


def test_wait_mode_finishes_on_the_old_version(dummy_server, sync, trainer_model):
    before = httpx.get(f"{dummy_server.url}/weight_version", headers=admin()).json()["weight_version"]
    results = _run_streams_with_push(dummy_server.url, sync, trainer_model, "wait", 300)
    for _chunks, finish, spans in results:
        assert finish == "length"
        assert [s["version"] for s in spans] == [before]
    assert httpx.get(f"{dummy_server.url}/weight_version", headers=admin()).json()["weight_version"] == 300


# -- refusals: nothing changes ---------------------------------------------------------------

def _state(url):
    return (httpx.get(f"{url}/weight_version", headers=admin()).json()["weight_version"],
            tokens(url, PROMPTS[0]))


def test_bad_updates_are_refused_and_change_nothing(dummy_server, sync, trainer_model):
    url = dummy_server.url
    state = _state(url)
    named = list(trainer_model.named_parameters())
    cases = {
        "unknown name": [("model.not_a_weight", torch.zeros(3))] + named,
        "wrong shape": [(n, torch.zeros(4, 4)) if i == 0 else (n, p) for i, (n, p) in enumerate(named)],
        "wrong dtype": [(n, p.to(torch.int32)) if i == 1 else (n, p) for i, (n, p) in enumerate(named)],
    }
    for what, tensors in cases.items():
        with pytest.raises(WeightTransferError) as e:
            sync.push(tensors)
        assert "400" in str(e.value), what
        name = tensors[0][0] if what != "wrong dtype" else named[1][0]
        assert name in str(e.value), what
        assert _state(url) == state
    # The same group still carries a good update afterwards.
    sync.push(named, version=state[0] + 1)
    assert _state(url)[0] == state[0] + 1


def test_control_plane_needs_the_admin_key(dummy_server):
    url = dummy_server.url
    for method, path in [("GET", "/get_world_size"), ("POST", "/pause"), ("POST", "/resume"),
                         ("POST", "/update_weights"), ("GET", "/weight_version")]:
        r = httpx.request(method, f"{url}{path}", json={"update_info": {}})
        assert r.status_code == 401, path
        assert "admin" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/is_paused", headers=admin()).json()["is_paused"] is False


@pytest.fixture(scope="module")
def rejecting_server(servers):
    return servers["rejecting"]


def test_update_before_init_is_refused(rejecting_server):
    url = rejecting_server.url
    r = httpx.post(f"{url}/update_weights", timeout=30, json={"update_info": dict(
        names=["model.norm.weight"], dtype_names=["float32"], shapes=[[576]])})
    assert r.status_code == 400
    assert "init_weight_transfer_engine" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/pause", params={"mode": "sideways"})
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "query.mode"  # named with its place, as vLLM names it


_DYING_TRAINER = r"""
import os, sys, torch
from transformers import AutoModelForCausalLM
from rlserve.weight_transfer import GlooWeightTransferEngine, TransferGroup
port, path = int(sys.argv[1]), sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
group = GlooWeightTransferEngine.trainer_init(dict(master_address="127.0.0.1", master_port=port, world_size=2))
print("ready", flush=True)
sys.stdin.readline()  # the test starts /update_weights, then lets us send
calls, real = [0], TransferGroup.broadcast
def dying(self, tensor, src=0):
    calls[0] += 1
    if calls[0] == 4:
        os._exit(17)  # a crash: no goodbye, sockets just close
    return real(self, tensor, src)
TransferGroup.broadcast = dying
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.01)
GlooWeightTransferEngine.trainer_send_weights(iterator=model.named_parameters(), group=group,
                                              packed=True, packed_buffer_size_bytes=32 << 20)
"""


def test_trainer_killed_midway_leaves_old_weights_serving(dummy_server, demo_model, trainer_model):
    url = dummy_server.url
    state = _state(url)
    port = get_open_port()
    trainer = subprocess.Popen([sys.executable, "-c", _DYING_TRAINER, str(port), demo_model],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    init = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)
    r = httpx.post(f"{url}/init_weight_transfer_engine", json={"init_info": init}, headers=admin(), timeout=120)
    assert r.status_code == 200, r.text
    assert trainer.stdout.readline().strip() == "ready"
    named = list(trainer_model.named_parameters())
    info = dict(names=[n for n, _ in named], dtype_names=["float32"] * len(named),
                shapes=[list(p.shape) for _, p in named], packed=True,
                packed_buffer_size_bytes=32 << 20)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        f"{url}/update_weights", json={"update_info": info}, headers=admin(), timeout=120)))
    started = time.time()
    t.start()
    trainer.stdin.write("go\n")
    trainer.stdin.flush()
    assert trainer.wait(timeout=60) == 17
    t.join(timeout=TRANSFER_TIMEOUT_S + 30)
    r = out["r"]
    assert r.status_code == 502, r.text
    assert "previous weights still serving" in r.json()["error"]["message"]
    assert time.time() - started < TRANSFER_TIMEOUT_S + 30
    assert httpx.get(f"{url}/health").status_code == 200
    assert _state(url) == state  # same version, token-identical output

    # A fresh init and update then succeed.
    client = WeightSyncClient(url, backend="gloo", admin_key=ADMIN_KEY)
    client.init()
    result = client.push(named, version=state[0] + 7)
    assert result.weight_versions == [state[0] + 7]


def test_sleep_and_wake_keep_serving_the_same_model(dummy_server, trainer_model, reference):
    url = dummy_server.url
    before = tokens(url, PROMPTS[1])
    assert httpx.post(f"{url}/sleep", params={"level": 1}, headers=admin()).status_code == 200
    assert httpx.get(f"{url}/is_sleeping", headers=admin()).json()["is_sleeping"] is True
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("tokens", tokens(url, PROMPTS[1])))
    t.start()
    t.join(timeout=2.0)
    assert t.is_alive()  # a request that arrives while asleep waits
    r = httpx.post(f"{url}/update_weights", headers=admin(), timeout=30, json={"update_info": dict(
        names=["model.norm.weight"], dtype_names=["float32"], shapes=[[576]])})
    assert r.status_code == 400 and "asleep" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/wake_up", headers=admin()).status_code == 200
    t.join(timeout=60)
    assert out["tokens"] == before
    assert tokens(url, PROMPTS[1]) == before

    # Level 2 drops the weights: after wake-up a full update brings the model back.
    assert httpx.post(f"{url}/sleep", params={"level": 2}, headers=admin()).status_code == 200
    assert httpx.post(f"{url}/sleep", params={"level": 3}, headers=admin()).status_code == 400
    assert httpx.post(f"{url}/wake_up", headers=admin()).status_code == 200
    client = WeightSyncClient(url, backend="gloo", admin_key=ADMIN_KEY)  # a group of its own
    client.init()
    client.push(trainer_model.named_parameters())
    for p in PROMPTS:
        assert tokens(url, p) == reference[p]


def test_reject_while_asleep_answers_503_and_serves_after_wake(rejecting_server):
    url = rejecting_server.url
    assert httpx.post(f"{url}/sleep").status_code == 200
    r = httpx.post(f"{url}/v1/completions", timeout=30, json=dict(model="m", prompt="Hi", max_tokens=2))
    assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.post(f"{url}/wake_up").status_code == 200
    assert len(greedy(url, "Hi", max_tokens=2)["choices"][0]["token_ids"]) == 2
