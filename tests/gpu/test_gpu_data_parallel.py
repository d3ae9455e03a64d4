"""Data parallel on GPUs: `--data-parallel-size 2` puts replica i on cuda:i. Two GPUs: both
replicas give the trainer's greedy tokens, and a replica killed with SIGKILL comes back
after copying replica 0's weights over NCCL (cuda:0 -> cuda:1). Three GPUs: a trainer on
cuda:2 pushes to both replicas in one NCCL group. Skipped with fewer GPUs.

Model, checkpoint and reference (float32, transformers) are test_gpu_two_server.py's, from
tests/helpers/two_gpu.py.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest
import torch

from helpers.data_parallel import complete_all, health, routed, wait_for
from helpers.servers import start_server, stop_server
from helpers.two_gpu import PROMPTS, llama_checkpoint, trainer_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu2,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return llama_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[str, list[int]]:
    return trainer_greedy(checkpoint)


def _greedy_all(url: str, model: str) -> dict[str, list[int]]:
    got = complete_all(url, PROMPTS, model=model, max_tokens=32)
    return {p: got[p]["choices"][0]["token_ids"] for p in PROMPTS}


def test_two_replicas_serve_and_a_killed_one_copies_weights_over_nccl(checkpoint, reference, tmp_path):
    srv = start_server(checkpoint, tmp_path / "server.log", "--device", "cuda:0", "--data-parallel-size", "2",
                       "--max-num-seqs", "16", "--weight-transfer-config", '{"backend": "nccl"}')
    try:
        assert _greedy_all(srv.url, checkpoint) == reference
        assert all(v > 0 for v in routed(srv.url).values())
        victim = health(srv.url).json()["replicas"][1]
        os.kill(victim["pid"], signal.SIGKILL)
        body = wait_for(lambda: (lambda b: b if b["replicas"][1]["state"] == "up" and
                                 b["replicas"][1]["restarts"] == 1 else None)(health(srv.url).json()),
                        300, "replica 1 back after copying weights")
        assert body["replicas"][1]["pid"] != victim["pid"]
        before = routed(srv.url)[1]
        assert _greedy_all(srv.url, checkpoint) == reference
        assert routed(srv.url)[1] > before
    finally:
        stop_server(srv)


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three CUDA devices (NCCL: one rank per GPU)")
def test_one_nccl_push_reaches_both_replicas(checkpoint, reference, tmp_path):
    """Replicas on cuda:0 and cuda:1 with dummy weights; the trainer on cuda:2."""
    from transformers import AutoModelForCausalLM

    from rlserve.weight_transfer import WeightSyncClient
    srv = start_server(checkpoint, tmp_path / "server.log", "--device", "cuda:0", "--data-parallel-size", "2",
                       "--load-format", "dummy", "--max-num-seqs", "16",
                       "--weight-transfer-config", '{"backend": "nccl"}')
    try:
        assert httpx.get(f"{srv.url}/get_world_size").json() == {"world_size": 2}
        assert _greedy_all(srv.url, checkpoint) != reference
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to("cuda:2")
        client = WeightSyncClient(srv.url, backend="nccl", device="cuda:2")
        client.init()
        result = client.push(hf.named_parameters(), version=5)
        assert [r["weight_version"] for r in result.answers[0]["replicas"]] == [5, 5]
        assert _greedy_all(srv.url, checkpoint) == reference
        assert all(v > 0 for v in routed(srv.url).values())
    finally:
        stop_server(srv)
