"""Helpers of the data-parallel tests (test_data_parallel.py, test_ray_cluster.py)."""

from __future__ import annotations

import re
import threading
import time

import httpx
import torch

from helpers.oracle import hf_greedy as oracle

PROMPTS = ["The capital of France is", "Hello, my name is", "def fibonacci(n):", "Once upon a time",
           "The quick brown fox", "In 1492, Columbus", "import numpy as np", "My favourite colour is"]
TOKENS = 12


def trainer_model(model_dir: str, seed: int = 0):
    """transformers' model of `model_dir`'s architecture with weights large enough that
    greedy decoding is decisive (random init at 0.02 leaves near-ties in the logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], n: int = TOKENS) -> list[int]:
    return oracle(model, prompt_ids, n)[0]


def complete(url: str, prompt: str, max_tokens: int = TOKENS, model: str = "m") -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
        return_token_ids=True))
    r.raise_for_status()
    return r.json()


def complete_all(url: str, prompts: list[str], **kw) -> dict[str, dict]:
    """All at once, so the router sees outstanding work on both replicas."""
    out: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda p=p: out.__setitem__(p, complete(url, p, **kw))) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def routed(url: str) -> dict[int, int]:
    """Requests each replica was given, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {int(i): int(float(v)) for i, v in
            re.findall(r'^rlserve_dp_requests_total\{engine="(\d+)"\} (\S+)$', text, re.M)}


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=30)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


def assert_replica_serves(url: str, replica: int, version: int, trainer, tokenizer) -> None:
    """Replica `replica` takes some of a batch, and every answer is the trainer's greedy
    output under `version`."""
    before = routed(url)
    got = complete_all(url, PROMPTS)
    assert routed(url)[replica] > before[replica]
    for p in PROMPTS:
        assert got[p]["weight_version"] == version
        assert got[p]["choices"][0]["token_ids"] == hf_greedy(trainer, tokenizer.encode(p)), p
