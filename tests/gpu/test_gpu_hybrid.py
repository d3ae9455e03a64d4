"""Hybrid models on CUDA: fla-core's gated delta rule against the torch reference (a batch of
sequences with their states, prefill and decode), and the engine's greedy tokens against
transformers on a small random Qwen3.5 and Qwen3-Next. Skipped without a GPU; the kernel
checks also without fla-core (the `gpu-hybrid` extra)."""

from __future__ import annotations

import pytest
import torch

from helpers.hybrid import hybrid_model, prompts
from helpers.oracle import hf_greedy
from rlserve import LLM, SamplingParams
from rlserve.ops import fla_gated_delta as fla
from rlserve.ops import gated_delta as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_fla = pytest.mark.skipif(not fla.available(), reason="needs fla-core (pip install 'rlserve[gpu-hybrid]')")


def _inputs(lengths: list[int], hk=4, h=8, dk=64, dv=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda")
    return (r(t, hk, dk), r(t, hk, dk), r(t, h, dv), -torch.rand(t, h, generator=g, device="cuda"),
            torch.rand(t, h, generator=g, device="cuda"), 0.1 * r(len(lengths), h, dk, dv))


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_prefill_matches_the_reference_per_sequence(dtype):
    lengths = [1, 37, 64, 200]
    q, k, v, g, beta, state = _inputs(lengths)
    spans, start = [], 0
    for n in lengths:
        spans.append((start, start + n))
        start += n
    out, final = fla.gated_delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), g, beta, state, spans, decode=False)
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    for i, (a, b) in enumerate(spans):
        want, want_state = ref.chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state[i])
        torch.testing.assert_close(out[a:b].float(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(final[i], want_state, atol=tol, rtol=tol)


@needs_fla
def test_fla_decode_matches_the_reference_step():
    q, k, v, g, beta, state = _inputs([1] * 16)
    spans = [(i, i + 1) for i in range(16)]
    out, final = fla.gated_delta_rule(q, k, v, g, beta, state, spans, decode=True)
    want, want_state = ref.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(final, want_state, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("decode", ["default", "in-place"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_greedy_tokens_equal_transformers_on_gpu(arch, decode, tmp_path, monkeypatch):
    """float32, the engine's GPU kernels (fla-core's where installed; "in-place": decode steps
    through ops/triton_gated_delta.py, RLSERVE_GDN_DECODE=triton) against transformers."""
    if decode == "in-place":
        from rlserve.model import gated_deltanet
        monkeypatch.setattr(gated_deltanet, "decode_in_place", lambda: True)
    hf = hybrid_model(arch)
    hf.save_pretrained(tmp_path)
    ids = prompts()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(str(tmp_path), device="cuda", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
             max_num_batched_tokens=64, gpu_memory_utilization=0.3) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    hf = hf.cuda()
    for prompt, o in zip(ids, outs):
        tokens = o.outputs[0].token_ids
        want, want_lp = hf_greedy(hf, prompt, 32, guess=tokens)
        assert tokens == want, arch
        got_lp = [x.logprob for x in o.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-2, arch


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_decode_graphs_equal_eager_steps(arch, tmp_path):
    """A hybrid model's decode steps replayed from CUDA graphs: each row reads and writes its
    own state slot, and the padding rows only the pool's spare one. Five prompts with output
    lengths from 8 to 40, so the batch shrinks through graph sizes it does not fill (5 and 3
    padded to 8 and 4): the tokens equal those of eager steps, as do their logprobs (within
    what the batch shape changes in float32)."""
    hybrid_model(arch).save_pretrained(tmp_path)
    ids = prompts(5)
    params = [SamplingParams(max_tokens=8 * (i + 1), temperature=0, ignore_eos=True, logprobs=0) for i in range(5)]
    got = {}
    for eager in (True, False):
        # A fixed KV cache: the suite's shards share the GPU, and a measured budget reads the
        # device's free memory, which the other shards move.
        with LLM(str(tmp_path), device="cuda", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
                 max_num_batched_tokens=256, kv_cache_memory_bytes=1 << 30, enforce_eager=eager) as llm:
            assert (llm.engine.executor.local_runner.graphs is None) == eager
            outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        got[eager] = [(o.outputs[0].token_ids, [x.logprob for x in o.outputs[0].logprobs]) for o in outs]
    for (want, want_lp), (tokens, lp) in zip(got[True], got[False]):
        assert tokens == want, arch
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) < 1e-3, arch
