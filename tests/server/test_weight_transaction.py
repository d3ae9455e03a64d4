"""Today's vLLM control plane against a real server over gloo: the start/update/finish
transaction, the calls around it, and vLLM's trainer API under its own names."""

from __future__ import annotations

import json
import threading
from functools import partial

import httpx
import pytest
import requests

from helpers.oracle import greedy_reference
from helpers.servers import start_server, start_side_by_side, start_tiny_server, stop_server
from rlserve.weight_transfer import (
    GlooTrainerInitInfo,
    GlooTrainerSendWeightsArgs,
    GlooWeightTransferEngine,
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
    get_open_port,
    rendezvous_address,
)

PROMPTS = ["The capital of France is", "Hello, my name is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def reference(hf_demo, offline_llm):
    return dict(zip(PROMPTS, greedy_reference(hf_demo, offline_llm, PROMPTS, 16)))


@pytest.fixture(scope="module")
def servers(demo_model, tmp_path_factory):
    """The module's two servers, started side by side, with no admin key (vLLM's examples
    call the control routes bare; loopback only here): "txn" (the demo model's architecture
    on dummy weights) and "timeout" (a small one whose idle transactions time out after 1 s,
    which its test shuts down)."""
    logs = tmp_path_factory.mktemp("txn")
    cfg = json.dumps({"backend": "gloo", "timeout_s": 60})  # also an idle transaction's timeout
    started = start_side_by_side(
        partial(start_server, demo_model, logs / "server.log", "--load-format", "dummy",
                "--weight-transfer-config", cfg, "--served-model-name", "m"),
        partial(start_tiny_server, logs / "timeout.log", "--weight-transfer-config",
                json.dumps({"backend": "gloo", "timeout_s": 1})))
    yield dict(zip(("txn", "timeout"), started))
    for srv in started:
        stop_server(srv)


@pytest.fixture(scope="module")
def server(servers):
    return servers["txn"]


def greedy(url: str, prompt: str, max_tokens: int = 16) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, return_token_ids=True, ignore_eos=True))
    r.raise_for_status()
    return r.json()


def tokens(url: str) -> dict[str, list[int]]:
    return {p: greedy(url, p)["choices"][0]["token_ids"] for p in PROMPTS}


def post(url: str, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{url}/{path}", json=body, timeout=120, **kw)


def checksums(url: str) -> dict[str, str]:
    r = post(url, "weight_checker", {"action": "checksum"})
    assert r.status_code == 200, r.text
    return r.json()["checksums"]


class Trainer:
    """A trainer joined to the server's group, pushing parts of a model by hand."""

    def __init__(self, url: str):
        self.url = url
        world_size = httpx.get(f"{url}/get_world_size").json()["world_size"] + 1
        port = get_open_port()
        info = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=world_size)
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", post(url, "init_weight_transfer_engine",
                                                                     {"init_info": info})))
        t.start()
        self.group = GlooWeightTransferEngine.trainer_init(dict(master_address="127.0.0.1", master_port=port,
                                                                world_size=world_size))
        t.join()
        assert box["r"].status_code == 200, box["r"].text

    def push(self, named: list, shapes: list | None = None) -> httpx.Response:
        info = dict(names=[n for n, _ in named], dtype_names=[str(p.dtype).split(".")[-1] for _, p in named],
                    shapes=shapes or [list(p.shape) for _, p in named], packed=True)
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", post(self.url, "update_weights",
                                                                     {"update_info": info})))
        t.start()
        try:
            GlooWeightTransferEngine.trainer_send_weights(iterator=iter(named), trainer_args=GlooTrainerSendWeightsArgs(
                group=self.group, packed=True))
        except Exception as e:  # a refused part: the server's answer says why
            box["trainer"] = e
        t.join()
        return box["r"]


def scramble(url: str, model) -> None:
    """Serve noise again, as the dummy weights did (so each test starts from nonsense)."""
    import torch
    gen = torch.Generator().manual_seed(0)
    trainer = Trainer(url)
    assert post(url, "start_weight_update", {"is_checkpoint_format": True}).status_code == 200
    noise = [(n, 0.05 * torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()]
    assert trainer.push(noise).status_code == 200
    assert post(url, "finish_weight_update", {}).status_code == 200


# -- vLLM's examples/rl/rlhf_http_nccl.py: imports changed (gloo for NCCL), get_ip() for the route --

def vllm_rlhf_http_nccl_flow(BASE_URL: str, train_model) -> None:
    from rlserve.weight_transfer import GlooTrainerSendWeightsArgs as NCCLTrainerSendWeightsArgs
    from rlserve.weight_transfer import GlooWeightTransferEngine as NCCLWeightTransferEngine

    def init_weight_transfer_engine(base_url, master_address, master_port, rank_offset, world_size):
        payload = {"init_info": dict(master_address=master_address, master_port=master_port,
                                     rank_offset=rank_offset, world_size=world_size)}
        requests.post(f"{base_url}/init_weight_transfer_engine", json=payload, timeout=60).raise_for_status()

    def update_weights(base_url, names, dtype_names, shapes, packed=False):
        payload = {"update_info": dict(names=names, dtype_names=dtype_names, shapes=shapes, packed=packed)}
        requests.post(f"{base_url}/update_weights", json=payload, timeout=300).raise_for_status()

    inference_world_size = requests.get(f"{BASE_URL}/get_world_size", timeout=10).json()["world_size"]
    world_size = inference_world_size + 1
    # The one line besides the imports: the group forms on the route to the server (get_ip()
    # is the outbound interface; this repository's tests stay on loopback).
    master_address, master_port, rank_offset = rendezvous_address(BASE_URL), get_open_port(), 1
    init_thread = threading.Thread(target=init_weight_transfer_engine,
                                   args=(BASE_URL, master_address, master_port, rank_offset, world_size))
    init_thread.start()
    model_update_group = NCCLWeightTransferEngine.trainer_init(
        dict(master_address=master_address, master_port=master_port, world_size=world_size))
    init_thread.join()
    requests.post(f"{BASE_URL}/pause", timeout=60).raise_for_status()
    names, dtype_names, shapes = [], [], []
    for name, p in train_model.named_parameters():
        names.append(name)
        dtype_names.append(str(p.dtype).split(".")[-1])
        shapes.append(list(p.shape))
    requests.post(f"{BASE_URL}/start_weight_update", json={"is_checkpoint_format": True},
                  timeout=60).raise_for_status()
    update_thread = threading.Thread(target=update_weights, args=(BASE_URL, names, dtype_names, shapes, True))
    update_thread.start()
    trainer_args = NCCLTrainerSendWeightsArgs(group=model_update_group, packed=True)
    NCCLWeightTransferEngine.trainer_send_weights(iterator=train_model.named_parameters(),
                                                  trainer_args=trainer_args)
    update_thread.join()
    requests.post(f"{BASE_URL}/finish_weight_update", json={}, timeout=60).raise_for_status()
    requests.post(f"{BASE_URL}/resume", timeout=60).raise_for_status()


def test_vllm_rlhf_http_nccl_flow_over_gloo_serves_the_real_model(server, hf_demo, reference):
    url = server.url
    scramble(url, hf_demo)
    assert all(tokens(url)[p] != reference[p] for p in PROMPTS)
    before = int(httpx.get(f"{url}/weight_info").json()["weight_version"])
    vllm_rlhf_http_nccl_flow(url, hf_demo)
    assert tokens(url) == reference
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": str(before + 1)}


def from_noise(url: str, model):
    """The server on noise: what it serves (tokens, checksums), the tensors, a trainer."""
    scramble(url, model)
    return tokens(url), checksums(url), list(model.named_parameters()), Trainer(url)


def test_two_updates_in_one_transaction_commit_both_at_finish(server, hf_demo, reference):
    url = server.url
    old, old_sums, named, trainer = from_noise(url, hf_demo)
    assert post(url, "start_weight_update", {"is_checkpoint_format": True}).json()["message"] == \
        "Weight update started"
    for part in (named[: len(named) // 2], named[len(named) // 2:]):
        r = trainer.push(part)
        assert r.status_code == 200 and r.json()["staged"] is True, r.text
        assert tokens(url) == old and checksums(url) == old_sums  # nothing served changes
    r = post(url, "finish_weight_update", {"weight_version": "41"})
    assert r.status_code == 200 and r.json()["message"] == "Weight update finished", r.text
    assert tokens(url) == reference
    assert greedy(url, PROMPTS[0])["weight_version"] == 41


def test_a_failed_second_part_commits_nothing_and_says_why(server, hf_demo, reference):
    url = server.url
    old, old_sums, named, trainer = from_noise(url, hf_demo)
    assert post(url, "start_weight_update").status_code == 200
    assert trainer.push(named[:2]).status_code == 200
    bad = [list(p.shape) for _, p in named[2:]]
    bad[0] = [bad[0][0] + 1, *bad[0][1:]]
    r = trainer.push(named[2:], shapes=bad)
    assert r.status_code == 400 and "wrong shapes" in r.text, r.text
    r = post(url, "finish_weight_update", {"weight_version": 7})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "nothing was committed" in message and "wrong shapes" in message and named[2][0] in message
    assert checksums(url) == old_sums and tokens(url) == old  # the old weights, bit for bit
    # The group stayed in step: the next transaction goes through.
    assert post(url, "start_weight_update").status_code == 200
    assert trainer.push(named).status_code == 200
    assert post(url, "finish_weight_update").status_code == 200
    assert tokens(url) == reference


def test_a_start_while_one_is_open_is_refused_by_name_and_leaves_it_to_its_owner(server, hf_demo):
    url = server.url
    scramble(url, hf_demo)  # the part pushed below must change what is served
    old_sums = checksums(url)
    trainer = Trainer(url)
    number = post(url, "start_weight_update").json()["transaction"]
    named = list(hf_demo.named_parameters())
    assert trainer.push(named[:1]).status_code == 200
    r = post(url, "start_weight_update")
    assert r.status_code == 409, r.text
    assert f"transaction {number}" in r.json()["error"]["message"] and "1 part(s) staged" in r.text
    assert checksums(url) == old_sums  # nothing served changed, and the open one is still open
    r = post(url, "finish_weight_update")
    assert r.status_code == 200 and r.json()["parts"] == 1, r.text
    assert checksums(url) != old_sums
    assert post(url, "start_weight_update", {"is_checkpoint_format": False}).status_code == 400
    assert post(url, "start_weight_update").status_code == 200
    assert post(url, "finish_weight_update").status_code == 200  # an empty transaction: a new version


def factory_engine(url: str, model):
    """vLLM's trainer factory, as rlhf_http_ipc.py calls it (gloo's init info for IPC's)."""
    return WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(master_address="127.0.0.1", master_port=get_open_port()),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))


def test_the_trainer_factory_runs_start_update_finish(server, hf_demo, reference):
    url = server.url
    scramble(url, hf_demo)
    factory_engine(url, hf_demo).send_weights()
    assert tokens(url) == reference


def test_weight_checker_compare_passes_on_pushed_weights_and_fails_on_a_perturbed_baseline(server, hf_demo):
    url = server.url
    engine = factory_engine(url, hf_demo)
    engine.send_weights()
    baseline = checksums(url)
    engine.send_weights()  # the same weights again
    assert post(url, "weight_checker", {"action": "compare", "baseline": baseline}).json() == \
        {"match": True, "mismatches": []}
    name = sorted(baseline)[0]
    perturbed = {**baseline, name: "0" * len(baseline[name])}
    assert post(url, "weight_checker", {"action": "compare", "baseline": perturbed}).json() == \
        {"match": False, "mismatches": [name]}
    assert post(url, "pause").status_code == 200
    assert post(url, "weight_checker", {"action": "checksum"}).status_code == 409
    assert post(url, "resume").status_code == 200


def test_update_weight_version_shows_in_weight_info_and_new_responses(server):
    url = server.url
    r = post(url, "update_weight_version", {"new_version": "123"})
    assert r.json() == {"success": True, "new_version": "123"}
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "123"}
    assert greedy(url, PROMPTS[0])["weight_version"] == 123
    assert post(url, "update_weight_version", {"new_version": 124}).json()["new_version"] == 124


def _stream(url: str, out: dict, key: str) -> None:
    body = dict(model="m", prompt=PROMPTS[0], max_tokens=900, temperature=0, stream=True, ignore_eos=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                out.setdefault(key + "_id", data["id"])
                out[key] = data["choices"][0].get("finish_reason") or out.get(key)


def test_abort_requests_by_id_and_all(server):
    import time
    url = server.url
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(url, out, k)) for k in ("a", "b", "c")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(f"{k}_id" in out for k in "abc") and time.monotonic() < deadline:
        time.sleep(0.05)
    # Frozen, so none of them finishes on its own meanwhile (abort_requests needs no pause).
    assert post(url, "pause", params={"mode": "keep"}).status_code == 200
    r = post(url, "abort_requests", {"request_ids": [out["a_id"], "no-such-request"]})
    assert r.json() == {"status": "aborted", "aborted": 1}
    threads[0].join(30)
    assert out["a"] == "abort" and threads[1].is_alive() and threads[2].is_alive()
    r = post(url, "abort_requests", {"request_ids": []})
    assert r.json() == {"status": "aborted", "aborted": 2}
    for t in threads[1:]:
        t.join(30)
    assert out["b"] == out["c"] == "abort"
    assert post(url, "resume").status_code == 200
    assert post(url, "abort_requests").json() == {"status": "aborted", "aborted": 0}


def test_get_world_size_with_and_without_data_parallel(server):
    assert httpx.get(f"{server.url}/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}
    assert httpx.get(f"{server.url}/get_world_size").json() == {"world_size": 1}


def test_an_open_transaction_is_abandoned_at_its_timeout_and_at_shutdown(servers):
    """A trainer that opened a transaction and vanished: after the transfer timeout the
    server abandons it (nothing staged is served), and a shutdown abandons it too."""
    import time

    srv = servers["timeout"]
    try:
        assert post(srv.url, "start_weight_update").status_code == 200
        time.sleep(2.5)
        r = post(srv.url, "finish_weight_update")
        assert r.status_code == 400 and "no weight update is open" in r.text, r.text
        assert "was abandoned after 1s without a call (its timeout)" in r.text
        assert post(srv.url, "start_weight_update").status_code == 200  # left open for the shutdown
    finally:
        stop_server(srv, wait=True)  # its log's last lines are the shutdown's
    log = srv.log.read_text()
    assert "no call for 1s (its timeout)" in log and "the server is shutting down" in log
