"""Tensor-parallel serving on CPU over gloo: TP=2 matches TP=1, live updates into
tensor-parallel servers, one push to two replicas, and a dead worker takes its server down."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch

from helpers.oracle import greedy_reference
from helpers.oracle import hf_greedy as oracle
from helpers.servers import start_server, start_side_by_side, start_tiny_server, stop_server
from rlserve.distributed import HeadShard, partition_heads, split_evenly
from rlserve.weight_transfer import WeightSyncClient

PROMPTS = ["The capital of France is", "Hello, my name is", "def fibonacci(n):"]
MAX_TOKENS = 16
SERVER_ARGS = ("--load-format", "dummy", "--served-model-name", "m", "--max-model-len", "256",
               "--weight-transfer-config", json.dumps({"backend": "gloo", "timeout_s": 60}))


# -- partitions -------------------------------------------------------------------------------

def test_uneven_head_partition_keeps_query_groups_with_their_kv_heads():
    # SmolLM2-135M: 9 query heads over 3 KV heads; two ranks take KV heads 2 + 1.
    assert [partition_heads(9, 3, 2, r) for r in range(2)] == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]
    # More ranks than KV heads: each KV head is replicated, its query group split (2 + 1).
    assert [partition_heads(6, 2, 4, r) for r in range(4)] == [
        HeadShard(0, 2, 0, 1), HeadShard(2, 1, 0, 1), HeadShard(3, 2, 1, 1), HeadShard(5, 1, 1, 1)]
    for heads, kv, world in [(9, 3, 3), (12, 12, 5), (32, 8, 8), (8, 2, 8)]:
        parts = [partition_heads(heads, kv, world, r) for r in range(world)]
        assert sum(p.num_q for p in parts) == heads
        assert [p.q_start for p in parts] == [sum(q.num_q for q in parts[:r]) for r in range(world)]
        for p in parts:  # every query head reads a KV head its rank holds
            group = heads // kv
            assert p.kv_start <= p.q_start // group
            assert (p.q_start + p.num_q - 1) // group < p.kv_start + p.num_kv
    with pytest.raises(ValueError, match="tensor_parallel_size 4"):
        partition_heads(9, 3, 4, 0)
    assert [split_evenly(49153, 2, r) for r in range(2)] == [(0, 24577), (24577, 24576)]


# -- references: transformers on the checkpoint, and on weights one step away ----------------------

@pytest.fixture(scope="module")
def trainer_model(demo_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()


def hf_greedy(model, tokenizer, prompt: str) -> list[int]:
    return oracle(model, tokenizer.encode(prompt), MAX_TOKENS)[0]


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(demo_model)


@pytest.fixture(scope="module")
def checkpoint_output(trainer_model, offline_llm) -> list[list[int]]:
    return greedy_reference(trainer_model, offline_llm, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def stepped(trainer_model, tokenizer, demo_model, checkpoint_output):
    """Weights a "training step" away from the checkpoint, and their greedy output."""
    from transformers import AutoModelForCausalLM
    gen = torch.Generator().manual_seed(1234)
    weights = [(n, p.detach() + 0.01 * torch.randn(p.shape, generator=gen))
               for n, p in trainer_model.named_parameters()]
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    model.load_state_dict(dict(weights), strict=False)
    expected = [hf_greedy(model, tokenizer, p) for p in PROMPTS]
    assert expected != checkpoint_output
    return weights, expected


# -- offline: TP=2 equals TP=1 ------------------------------------------------------------------

def test_tp2_greedy_output_equals_tp1(demo_model, offline_llm, stepped):
    from rlserve import LLM, SamplingParams
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2, ignore_eos=True)
    expected = offline_llm.generate(PROMPTS, params)
    llm = LLM(demo_model, device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2)
    try:
        assert llm.engine.world_size == 2
        attn = llm.engine.executor.local_runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (6, 2)  # rank 1 holds the other 3 + 1
        got = llm.generate(PROMPTS, params)
        for e, g in zip(expected, got):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            for a, b in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
        # Offline updates reach every rank too (rank 0 broadcasts, each keeps its shards).
        weights, expected = stepped
        llm.engine.apply_weights(weights)
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == expected
    finally:
        llm.engine.shutdown()


# -- servers: live updates -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def replicas(demo_model, tmp_path_factory):
    """A TP=1 and a TP=2 server, both on dummy weights with the gloo control plane."""
    logs = tmp_path_factory.mktemp("tp")
    started = start_side_by_side(*(partial(start_server, demo_model, logs / f"tp{tp}.log", *SERVER_ARGS,
                                           "--tensor-parallel-size", str(tp)) for tp in (1, 2)))
    yield tuple(started)
    for srv in started:
        stop_server(srv)


def completion(url: str, prompt: str) -> tuple[list[int], int]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
        model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
        return_token_ids=True))
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["token_ids"], body["weight_version"]


def completions(url: str) -> list[tuple[list[int], int]]:
    """All prompts at once, so the server batches them."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: completion(url, p), PROMPTS))


def outputs(url: str) -> list[list[int]]:
    return [tokens for tokens, _ in completions(url)]


def test_live_update_into_tp2_matches_tp1(replicas, trainer_model, checkpoint_output):
    tp1, tp2 = replicas
    assert [httpx.get(f"{s.url}/get_world_size").json()["world_size"] for s in replicas] == [1, 2]
    # Dummy weights are drawn at full size and sharded: both serve the same dummy model.
    assert outputs(tp1.url) == outputs(tp2.url)
    expected = checkpoint_output
    for srv in replicas:  # the same update, into each server on its own
        client = WeightSyncClient(srv.url, backend="gloo", timeout_s=120)
        client.init()
        assert client.push(trainer_model.named_parameters(), version=5).weight_versions == [5]
    assert outputs(tp2.url) == outputs(tp1.url) == expected


def test_one_push_updates_two_replicas(replicas, stepped):
    weights, expected = stepped
    tp1, tp2 = replicas
    client = WeightSyncClient([tp1.url, tp2.url], backend="gloo", timeout_s=120)
    client.init()  # one group: trainer, TP=1 at rank 1, TP=2 at ranks 2 and 3
    result = client.push(weights, version=9)
    assert result.weight_versions == [9, 9]
    for srv in replicas:
        assert completions(srv.url) == [(e, 9) for e in expected]


# -- failure ---------------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _descendants(pid: int) -> list[int]:
    kids = _children(pid)
    return kids + [d for k in kids for d in _descendants(k)]


def _tp_workers(pid: int) -> list[int]:
    """The tensor-parallel worker processes under a server (the engine process starts them)."""
    return [d for d in _descendants(pid)
            if b"rlserve.worker.worker_proc" in Path(f"/proc/{d}/cmdline").read_bytes()]


def test_dead_worker_takes_the_server_down(tmp_path):
    srv = start_tiny_server(tmp_path / "tp2.log", "--max-model-len", "128", "--tensor-parallel-size", "2")
    try:
        (worker,) = _tp_workers(srv.process.pid)
        events = []
        body = dict(model="m", prompt=PROMPTS[0], max_tokens=100, ignore_eos=True, stream=True)
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:
                        os.kill(worker, signal.SIGKILL)  # mid-generation
        # The request in flight ends with an error that names the lost rank.
        assert "rank 1" in events[-1]["error"]["message"]
        assert len(events) < 100
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503
        assert "rank 1" in health.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                       json=dict(model="m", prompt=PROMPTS[0], max_tokens=4))
        assert r.status_code >= 500
    finally:
        stop_server(srv)
