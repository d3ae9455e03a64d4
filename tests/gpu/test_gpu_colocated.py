"""Colocated mode on one GPU: the flow of vLLM's RLHF-over-HTTP example over CUDA IPC, and sleep / wake.

The trainer is this test process (a transformers model on the GPU); the server is a
separate `rlserve serve` process on the same GPU with dummy weights. Skipped without CUDA.
"""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

from helpers.checkpoints import random_qwen3_checkpoint
from helpers.servers import start_server, stop_server
from rlserve.weight_transfer import IPCWeightTransferEngine, UpdateRefusedError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 4096
PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((5, 23, 64, 150))]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A random Qwen3 checkpoint, and a word-level tokenizer for it."""
    path = tmp_path_factory.mktemp("colocated")
    random_qwen3_checkpoint(path, VOCAB, 512, tie_word_embeddings=True)
    return str(path)


@pytest.fixture(scope="module")
def trainer(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("colocated-server") / "server.log"
    srv = start_server(checkpoint, log, "--device", "cuda", "--dtype", "bfloat16",
                       "--load-format", "dummy", "--gpu-memory-utilization", "0.3",
                       "--served-model-name", "m",
                       "--weight-transfer-config", '{"backend": "ipc"}')
    yield srv
    stop_server(srv)


def complete(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
        model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
        return_token_ids=True, ignore_eos=True))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def outputs(url: str) -> list[list[int]]:
    return [complete(url, p)[0] for p in PROMPTS]


def rlhf_http_push(url: str, sender, named, version: int) -> dict:
    """The order of vLLM's RLHF-over-HTTP example: pause, send, resume (the ipc send posts the update itself)."""
    httpx.post(f"{url}/pause", params={"mode": "keep"}).raise_for_status()
    try:
        return IPCWeightTransferEngine.trainer_send_weights(
            named, {"url": url, "weight_version": version}, group=sender)
    finally:
        httpx.post(f"{url}/resume").raise_for_status()


def assert_matches_trainer(url: str, hf) -> None:
    """Teacher-forced on the server's own tokens: its logprobs are the trainer's and each
    greedy token is the trainer's argmax, or a near-tie that bf16 rounding may flip."""
    diffs, same, total = [], 0, 0
    for prompt in PROMPTS:
        toks, lps = complete(url, prompt)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + toks], device="cuda")).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        for i, (tok, lp) in enumerate(zip(toks, lps)):
            diffs.append(abs(lp - ref[i, tok].item()))
            total += 1
            if tok == int(ref[i].argmax()):
                same += 1
            else:
                assert (ref[i].max() - ref[i, tok]).item() < 0.1, (prompt[:3], i)
    diffs_t = torch.tensor(diffs)
    print(f"logprob |ours - trainer|: mean {diffs_t.mean():.4f}, max {diffs_t.max():.4f}; "
          f"greedy token = trainer's argmax at {same} of {total} steps (the rest near-ties)")
    assert diffs_t.mean() < 0.05 and diffs_t.max() < 0.3
    assert same >= 0.9 * total


@pytest.fixture(scope="module")
def sender(server):
    r = httpx.post(f"{server.url}/init_weight_transfer_engine", json={"init_info": {}})
    assert r.status_code == 200, r.text
    return IPCWeightTransferEngine.trainer_init()


def test_colocated_rlhf_http_flow_serves_the_trainers_weights(server, sender, trainer):
    url = server.url
    assert httpx.get(f"{url}/get_world_size").json() == {"world_size": 1}
    before = outputs(url)
    result = rlhf_http_push(url, sender, trainer.named_parameters(), version=1)
    assert result["weight_version"] == 1 and sender.exported_last > 0
    assert outputs(url) != before
    assert_matches_trainer(url, trainer)

    # A second push reuses every handle; the server copies again (same weights, same output).
    after = outputs(url)
    rlhf_http_push(url, sender, trainer.named_parameters(), version=2)
    assert sender.exported_last == 0
    assert outputs(url) == after


def test_reallocated_parameter_is_re_registered(server, sender, trainer):
    url = server.url
    norm = trainer.model.norm
    original = norm.weight.data
    expected = outputs(url)
    norm.weight.data = torch.zeros_like(original)  # new storage: hidden states become zero
    rlhf_http_push(url, sender, trainer.named_parameters(), version=3)
    assert sender.exported_last == 1
    # Zero logits everywhere: greedy picks token 0 at every step.
    assert all(toks == [0] * MAX_TOKENS for toks in outputs(url))
    norm.weight.data = original
    rlhf_http_push(url, sender, trainer.named_parameters(), version=4)
    assert outputs(url) == expected


def test_malformed_handles_are_refused_and_the_old_weights_serve(server, sender, trainer):
    url = server.url
    expected = outputs(url)
    info = sender.update_info(trainer.named_parameters())

    def post(update_info) -> httpx.Response:
        return httpx.post(f"{url}/update_weights", json={"update_info": update_info}, timeout=60)

    bad = copy.deepcopy(info)
    bad["ipc_handles"]["storages"][0]["handle"] = "AAAA" * 22  # 66 zero bytes: no such allocation
    bad["ipc_handles"]["storages"][0]["offset_bytes"] += 1  # not a cached storage either
    r = post(bad)
    assert r.status_code == 400 and "storages[0]" in r.json()["error"]["message"], r.text

    bad = copy.deepcopy(info)
    bad["ipc_handles"]["tensors"][0]["offset"] = 1 << 40
    r = post(bad)
    assert r.status_code == 400 and "past the end of its storage" in r.json()["error"]["message"]

    bad = copy.deepcopy(info)
    bad["ipc_handles"]["device_uuid"] = "GPU-00000000-0000-0000-0000-000000000000"
    r = post(bad)
    assert r.status_code == 400 and "same GPU" in r.json()["error"]["message"]

    with pytest.raises(UpdateRefusedError, match="shape"):
        IPCWeightTransferEngine.trainer_send_weights(
            [("model.norm.weight", torch.zeros(3, device="cuda"))], {"url": url}, group=sender)
    assert outputs(url) == expected
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_warm_push_is_a_reference_and_a_lost_document_is_sent_whole(server, trainer):
    """WeightSyncClient sends an unchanged document as a reference to the one the server
    holds; a server that lost it refuses the reference by name and gets the whole document."""
    from rlserve.weight_transfer import WeightSyncClient
    url = server.url
    sync = WeightSyncClient(url, backend="ipc")
    sync.init()
    sync.push(trainer.named_parameters(), version=20)
    expected = outputs(url)
    info = sync.group[0].update_info(trainer.named_parameters(), reference=True)
    assert set(info) == {"ipc_handles"} and set(info["ipc_handles"]) == {"same_as"}
    assert sync.push(trainer.named_parameters(), version=21).weight_versions == [21]
    assert outputs(url) == expected

    r = httpx.post(f"{url}/update_weights", json={"update_info": {"ipc_handles": {"same_as": "0" * 16},
                                                                  "weight_version": 22}}, timeout=60)
    assert r.status_code == 400 and "ipc_handles.same_as" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/update_weights", json={"update_info": {**info, "names": ["model.norm.weight"]}},
                   timeout=60)
    assert r.status_code == 400 and "exclude each other" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{url}/weight_version").json() == {"weight_version": 21}
    assert outputs(url) == expected

    # A new init gives the server fresh receivers: the reference misses and the client resends.
    httpx.post(f"{url}/init_weight_transfer_engine", json={"init_info": {}}).raise_for_status()
    assert sync.push(trainer.named_parameters(), version=23).weight_versions == [23]
    assert outputs(url) == expected


def _kv_and_weight_bytes(url: str, hf) -> int:
    metrics = httpx.get(f"{url}/metrics").text
    capacity = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("rlserve_kv_cache_capacity_tokens"))
    c = hf.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2  # bf16 K and V
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    return int(capacity * per_token + weights)


def test_sleep_returns_the_memory_and_wake_restores_the_output(server, sender, trainer):
    url = server.url
    expected = outputs(url)
    held = _kv_and_weight_bytes(url, trainer)
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    assert httpx.post(f"{url}/sleep", params={"level": 1}).status_code == 200
    free_asleep = torch.cuda.mem_get_info()[0]  # seen from this process, not the server
    freed = free_asleep - free_awake
    print(f"sleep level 1: {freed / 2**30:.2f} GiB of {held / 2**30:.2f} GiB (KV cache + weights) "
          f"returned ({freed / held:.1%})")
    assert freed >= 0.9 * held
    assert httpx.post(f"{url}/wake_up").status_code == 200
    assert outputs(url) == expected

    # Level 2 drops the weights: one full push after wake-up brings the model back.
    assert httpx.post(f"{url}/sleep", params={"level": 2}).status_code == 200
    assert torch.cuda.mem_get_info()[0] - free_awake >= 0.9 * held
    assert httpx.post(f"{url}/wake_up").status_code == 200
    rlhf_http_push(url, sender, trainer.named_parameters(), version=5)
    assert outputs(url) == expected


def test_vllm_rlhf_http_ipc_flow_with_the_trainer_factory(server, trainer):
    """rlhf_http_ipc.py's calls with the imports changed: the factory with IPC's init info,
    an HTTP client and a module source; send_weights() runs start/update/finish."""
    from rlserve.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        IPCTrainerInitInfo,
        ModuleSource,
        WeightTransferTrainerFactory,
    )
    url = server.url
    scrambled = copy.deepcopy(trainer)
    with torch.no_grad():
        for p in scrambled.parameters():
            p.mul_(-1.0)
    for model in (scrambled, trainer):
        engine = WeightTransferTrainerFactory.trainer_init(
            init_info=IPCTrainerInitInfo(), client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
        httpx.post(f"{url}/pause", params={"mode": "keep"}).raise_for_status()
        try:
            engine.send_weights()
        finally:
            httpx.post(f"{url}/resume").raise_for_status()
        if model is scrambled:
            scrambled_out = outputs(url)
    assert outputs(url) != scrambled_out
    assert_matches_trainer(url, trainer)
