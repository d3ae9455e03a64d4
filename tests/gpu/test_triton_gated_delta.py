"""Gated DeltaNet's in-place decode step (ops/triton_gated_delta.py) against the torch
recurrence (ops/gated_delta.py) on fresh random inputs: the outputs, each row's state written
back to its own slot (a fresh row's from zeros), and every other slot of the pool untouched.

Needs CUDA and triton; with RLSERVE_TRITON_INTERPRET=1 it runs on the CPU through Triton's
interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.hybrid import hybrid_model, prompts
from helpers.triton_lane import DEVICE, INTERPRET, KERNEL_MARKS
from rlserve.ops import gated_delta as ref

pytestmark = KERNEL_MARKS


def _step(*args):
    from rlserve.ops import triton_gated_delta
    return triton_gated_delta.decode_step(*args)


@pytest.mark.parametrize("n,k_heads,heads,dk,dv,dtype", [
    (1, 1, 1, 16, 16, torch.float32), (5, 2, 4, 16, 24, torch.float32), (6, 2, 2, 32, 96, torch.bfloat16),
    (3, 4, 8, 128, 128, torch.bfloat16)])
def test_decode_step_updates_each_rows_slot_in_place(n, k_heads, heads, dk, dv, dtype):
    gen = torch.Generator().manual_seed(n * dk + dv)
    q = torch.randn(n, k_heads, dk, generator=gen).to(dtype)
    k = torch.randn(n, k_heads, dk, generator=gen).to(dtype)
    v = torch.randn(n, heads, dv, generator=gen).to(dtype)
    g = -torch.rand(n, heads, generator=gen) * 2
    beta = torch.rand(n, heads, generator=gen)
    pool = torch.randn(n + 3, heads, dk, dv, generator=gen)
    slots = torch.randperm(n + 3, generator=gen)[:n].to(torch.int32)
    fresh = torch.zeros(n, dtype=torch.bool)
    fresh[::2] = True
    pool[slots[0].long()] = float("nan")  # a stale slot of a fresh row may hold anything
    initial = pool[slots.long()].masked_fill(fresh[:, None, None, None], 0)
    want_out, want_state = ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    want_pool = pool.clone()
    want_pool[slots.long()] = want_state

    pool_dev = pool.to(DEVICE)
    out = _step(*(x.to(DEVICE) for x in (q, k, v, g, beta)), pool_dev, slots.to(DEVICE), fresh.to(DEVICE))
    assert out.dtype == torch.float32 and out.shape == (n, heads, dv)
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool_dev.cpu(), want_pool, rtol=1e-4, atol=1e-4)  # the others untouched


def test_views_of_the_projection_are_read_in_place():
    """q and k as the layer has them: column slices of one projection's rows."""
    gen = torch.Generator().manual_seed(7)
    n, hk, h, dk, dv = 4, 2, 4, 16, 16
    mixed = torch.randn(n, 2 * hk * dk + h * dv, generator=gen)
    q, k, v = mixed.split([hk * dk, hk * dk, h * dv], dim=-1)
    q, k, v = q.view(n, hk, dk), k.view(n, hk, dk), v.view(n, h, dv)
    g, beta = -torch.rand(n, h, generator=gen), torch.rand(n, h, generator=gen)
    pool = torch.randn(n, h, dk, dv, generator=gen)
    slots, fresh = torch.arange(n, dtype=torch.int32), torch.zeros(n, dtype=torch.bool)
    want_out, want_state = ref.recurrent_gated_delta_rule(q, k, v, g, beta, pool.clone())
    pool_dev = pool.to(DEVICE)
    out = _step(*(x.to(DEVICE) for x in (q, k, v, g, beta)), pool_dev, slots.to(DEVICE), fresh.to(DEVICE))
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool_dev.cpu(), want_state, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not INTERPRET, reason="on CUDA, test_gpu_hybrid.py runs the engine with it")
def test_the_engines_decode_steps_through_the_kernel_give_the_reference_tokens(tmp_path, monkeypatch):
    """The CPU engine on a small Qwen3.5, its decode steps through the kernel (in Triton's
    interpreter) against the same engine on the torch recurrence."""
    from rlserve import LLM, SamplingParams
    from rlserve.model import gated_deltanet
    from rlserve.ops.kernels import TORCH
    hybrid_model("qwen3_5").save_pretrained(tmp_path)
    ids = prompts(4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256) as llm:
        want = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        monkeypatch.setattr(gated_deltanet, "decode_in_place", lambda: True)
        interpreted = dataclasses.replace(TORCH, name="interpreted")  # any set but torch's
        for layer in gated_deltanet.linear_attention_layers(llm.engine.executor.local_runner.model):
            layer.kernels = interpreted
        got = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 1e-4
