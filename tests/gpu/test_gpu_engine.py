"""The engine on CUDA (Triton kernels, CUDA graphs) against transformers. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_engine import cuda_llm, engine_prompts, qwen3_checkpoint, random_checkpoint
from helpers.oracle import hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return qwen3_checkpoint(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A random Qwen3-MoE checkpoint (32 experts, top-4, one dense layer) and its HF model."""
    from transformers import Qwen3MoeConfig
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         architectures=["Qwen3MoeForCausalLM"])
    return random_checkpoint(tmp_path_factory.mktemp("qwen3-moe"), cfg)


def _hf_greedy(hf, ids, n):
    return hf_greedy(hf, ids, n)[0]


def _prompt_logprob_gap(llm, hf) -> torch.Tensor:
    """|our prompt logprobs - transformers' float32 ones| over the 300-token prompt."""
    from rlserve import SamplingParams
    ids = engine_prompts()[4]
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0].float(), -1)
    ours = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    theirs = torch.tensor([ref[i, t].item() for i, t in enumerate(ids[1:])])
    return (ours - theirs).abs()


@pytest.fixture(scope="module", params=["dense", "moe"])
def dense_or_moe(request):
    """Each of the two checkpoints (the MoE one runs the Triton fused MoE in the graphs)."""
    return request.getfixturevalue("checkpoint" if request.param == "dense" else "moe_checkpoint")


def test_float32_greedy_matches_transformers_with_cuda_graphs(dense_or_moe):
    from rlserve import SamplingParams
    path, hf = dense_or_moe
    llm = cuda_llm(path, "float32")
    assert llm.engine.executor.local_runner.graphs is not None
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, detokenize=False)
    outs = llm.generate(engine_prompts(), params)
    for ids, out in zip(engine_prompts(), outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, ids, 24)


def test_bf16_logprobs_agree_with_transformers(dense_or_moe):
    path, hf = dense_or_moe
    gap = _prompt_logprob_gap(cuda_llm(path, "bfloat16"), hf)
    assert gap.mean() < 0.05
    assert gap.max() < 0.5


def test_whole_vocabulary_logprobs_on_the_gpu_paths(checkpoint):
    """logprobs=-1 and prompt_logprobs=-1 through CUDA graphs, overlapped scheduling and the
    fused sampler, beside rows asking for fewer: every token once, probabilities summing to
    1, the sampled token's own logprob and rank, the greedy token first."""
    import math

    from rlserve import SamplingParams
    path, _ = checkpoint
    llm = cuda_llm(path, "float32", max_logprobs=-1)
    assert llm.engine.async_scheduling and llm.engine.executor.local_runner.fused_sampling
    ids = engine_prompts()[:3]
    plain = dict(max_tokens=8, ignore_eos=True, detokenize=False)
    greedy = llm.generate(ids[:1], SamplingParams(temperature=0, **plain))[0].outputs[0].token_ids
    outs = llm.generate(ids, [SamplingParams(temperature=0, logprobs=-1, prompt_logprobs=-1, **plain),
                              SamplingParams(temperature=0.8, seed=1, logprobs=-1, **plain),
                              SamplingParams(temperature=0, logprobs=2, **plain)])
    assert outs[0].outputs[0].token_ids == greedy
    assert all(len(lp.top) == 2 for lp in outs[2].outputs[0].logprobs)
    for i, out in enumerate(outs[:2]):
        for lp in out.outputs[0].logprobs + (out.prompt_logprobs[1:] if i == 0 else []):
            top_ids, top_lps = lp.top.arrays()
            assert sorted(top_ids.tolist()) == list(range(4096))
            assert math.fsum(math.exp(v) for v in top_lps.tolist()) == pytest.approx(1.0, abs=1e-3)
            assert dict(zip(top_ids.tolist(), top_lps.tolist()))[lp.token_id] == lp.logprob
            assert lp.rank == 1 + int((top_lps > lp.logprob).sum())
    assert all(lp.top[0][0] == lp.token_id for lp in outs[0].outputs[0].logprobs)


def test_graphs_and_eager_give_the_same_tokens(checkpoint):
    from rlserve import SamplingParams
    path, _ = checkpoint
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False)
    graphs = [o.outputs[0].token_ids for o in cuda_llm(path, "bfloat16").generate(engine_prompts(), params)]
    eager = [o.outputs[0].token_ids
             for o in cuda_llm(path, "bfloat16", enforce_eager=True).generate(engine_prompts(), params)]
    same = sum(a == b for a, b in zip(graphs, eager))
    assert same >= len(graphs) - 1  # bf16: batch shape may flip a near-tie, rarely


def test_fp8_kv_cache_stays_close_to_transformers(checkpoint):
    """kv_cache_dtype="fp8" through the Triton stores, attention and CUDA graphs: prompt
    logprobs (keys read back from the fp8 cache) near transformers', and the decode graphs
    give eager's tokens."""
    from rlserve import SamplingParams
    path, hf = checkpoint
    llm = cuda_llm(path, "bfloat16", kv_cache_dtype="fp8")
    assert llm.engine.executor.local_runner.kv_cache.dtype == torch.float8_e4m3fn
    gap = _prompt_logprob_gap(llm, hf)
    assert gap.mean() < 0.1
    assert gap.max() < 1.0
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False)
    graphs = [o.outputs[0].token_ids for o in llm.generate(engine_prompts(), params)]
    eager = cuda_llm(path, "bfloat16", kv_cache_dtype="fp8", enforce_eager=True)
    same = sum(a == o.outputs[0].token_ids for a, o in zip(graphs, eager.generate(engine_prompts(), params)))
    assert same >= len(graphs) - 1


def test_live_update_keeps_graphs_valid(checkpoint):
    from rlserve import SamplingParams
    path, hf = checkpoint
    llm = cuda_llm(path, "float32", load_format="dummy")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False)
    llm.engine.apply_weights(list(hf.named_parameters()))
    ids = engine_prompts()[2]
    assert llm.generate([ids], params)[0].outputs[0].token_ids == _hf_greedy(hf, ids, 16)


def test_waking_weights_then_kv_cache_recaptures_graphs_on_the_new_weights(checkpoint):
    """vLLM's RL order after a level-2 sleep: wake the weights, update them, then wake the
    KV cache; the graphs are captured again once both are back, and serve the update."""
    from rlserve import SamplingParams
    path, hf = checkpoint
    llm = cuda_llm(path, "float32", load_format="dummy")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()
    llm.update_weights(hf.named_parameters())
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping() and llm.engine.executor.local_runner.graphs is not None
    ids = engine_prompts()[2]
    assert llm.generate([ids], params)[0].outputs[0].token_ids == _hf_greedy(hf, ids, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [False, True])
def test_fused_rope_matches_the_torch_path(dtype, norm):
    """The fused kernel, in place on strided views of a qkv tensor, against the torch ops."""
    from rlserve.model.layers import RotaryEmbedding
    from rlserve.ops.fused_ref import rms_norm
    from rlserve.ops.triton_rotary import rope_
    torch.manual_seed(0)
    t, hq, hk, d = 37, 16, 8, 128
    rope = RotaryEmbedding(d, 4096, 1e6).cuda()
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=dtype)
    positions = torch.randint(0, 4096, (t,), device="cuda")
    qw = torch.empty(d, device="cuda", dtype=dtype).uniform_(0.5, 1.5) if norm else None
    kw = torch.empty(d, device="cuda", dtype=dtype).uniform_(0.5, 1.5) if norm else None

    def views(x):
        q, k, _ = x.split([hq * d, hk * d, hk * d], dim=-1)
        return q.view(t, hq, d), k.view(t, hk, d)

    ref_in = qkv.clone()
    q, k = views(ref_in)
    with torch.no_grad():
        if norm:  # the torch reference, never a Triton kernel
            q = rms_norm(q.float(), qw.float(), 1e-6).to(dtype)
            k = rms_norm(k.float(), kw.float(), 1e-6).to(dtype)
        cos = rope.cos[positions].unsqueeze(1)
        sin = rope.sin[positions].unsqueeze(1)
        from rlserve.ops.fused_ref import rotate as _rotate
        ref_q, ref_k = _rotate(q.float(), cos, sin), _rotate(k.float(), cos, sin)
    q, k = views(qkv)
    rope_(q, k, positions, rope.cos, rope.sin, qw, kw, 1e-6)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(q.float(), ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k.float(), ref_k, rtol=tol, atol=tol)
    # Values are untouched.
    torch.testing.assert_close(qkv[:, (hq + hk) * d:], ref_in[:, (hq + hk) * d:])


def test_fused_sampling_draws_from_the_tempered_distribution():
    from rlserve.ops.triton_sampling import gumbel_sample
    torch.manual_seed(0)
    logits = (torch.randn(64) * 0.7).cuda()
    rows = 40000
    seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 104729 + 7
    tokens = gumbel_sample(logits.to(torch.bfloat16).repeat(rows, 1), torch.full((rows,), 0.8, device="cuda"), seeds)
    freq = torch.bincount(tokens, minlength=64).float() / rows
    p = torch.softmax(logits.to(torch.bfloat16).float() / 0.8, -1)
    assert (freq - p).abs().max() < 0.01
    again = gumbel_sample(logits.repeat(3, 1), torch.full((3,), 0.8, device="cuda"), seeds[:3])
    assert again.tolist() == gumbel_sample(logits.repeat(rows, 1), torch.full((rows,), 0.8, device="cuda"),
                                           seeds)[:3].tolist()


def test_seeded_sampling_on_gpu_is_reproducible(checkpoint):
    # Batch independence is asserted on CPU in float32; in bf16 a different batch shape can
    # move a logit by an ulp, so here the same call must simply repeat exactly.
    from rlserve import SamplingParams
    path, _ = checkpoint
    llm = cuda_llm(path, "float32")
    assert llm.engine.executor.local_runner.fused_sampling
    p = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=16, ignore_eos=True, detokenize=False)
    alone = [o.token_ids for o in llm.generate([engine_prompts()[0]], p)[0].outputs]
    assert alone == [o.token_ids for o in llm.generate([engine_prompts()[0]], p)[0].outputs]
    crowd = llm.generate(engine_prompts(), [p] + [SamplingParams(temperature=0.7, max_tokens=20, detokenize=False)] * 5)
    assert alone == [o.token_ids for o in crowd[0].outputs]
    assert alone[0] != alone[1]


def test_fused_sampling_splits_a_large_vocabulary_without_changing_the_draw():
    from rlserve.ops.triton_sampling import SPLIT_COLUMNS, gumbel_sample
    vocab, rows = 151936, 20000
    logits = torch.full((vocab,), -40.0, device="cuda")
    # Mass in the first, a middle and the last split, and twice within one split.
    mid = 8 * SPLIT_COLUMNS
    peaks = torch.tensor([3, mid + 5, mid + SPLIT_COLUMNS // 2, 151935], device="cuda")
    logits[peaks] = torch.tensor([1.0, 1.5, 0.2, 0.5], device="cuda")
    assert len(set((peaks // SPLIT_COLUMNS).tolist())) == 3
    seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 7919 + 11
    temp = torch.full((rows,), 0.7, device="cuda")
    tokens = gumbel_sample(logits.expand(rows, vocab), temp, seeds)
    freq = torch.stack([(tokens == p).float().mean() for p in peaks])
    assert (freq - torch.softmax(logits[peaks] / 0.7, -1)).abs().max() < 0.015
    # A row's token does not depend on the batch: alone, or among other rows at another
    # position, it is the same.
    torch.manual_seed(1)
    x = (torch.randn(64, vocab, device="cuda") * 3).to(torch.bfloat16)
    temp = torch.rand(64, device="cuda") + 0.3
    seeds = torch.randint(0, 2 ** 62, (64,), device="cuda")
    batch = gumbel_sample(x, temp, seeds)
    other = (torch.randn(100, vocab, device="cuda") * 3).to(torch.bfloat16)
    for i in (0, 17, 63):
        assert gumbel_sample(x[i:i + 1], temp[i:i + 1], seeds[i:i + 1]).item() == batch[i].item()
        mixed = torch.cat([other[:i + 5], x[i:i + 1], other[i + 5:]])
        t = torch.cat([temp.repeat(2)[:i + 5], temp[i:i + 1], temp.repeat(2)[i + 5:100]])
        s = torch.cat([seeds.repeat(2)[:i + 5] + 1, seeds[i:i + 1], seeds.repeat(2)[i + 5:100]])
        assert gumbel_sample(mixed, t, s)[i + 5].item() == batch[i].item()
    # ... and different seeds draw different tokens.
    flat = torch.zeros(1, vocab, device="cuda").expand(64, vocab)
    assert len(set(gumbel_sample(flat, torch.ones(64, device="cuda"), torch.arange(64, device="cuda")).tolist())) > 60


def test_fused_sampling_skips_masked_columns_and_mixes_temperatures():
    from rlserve.ops.triton_sampling import SPLIT_COLUMNS, gumbel_sample
    vocab, rows = 151936, 80000
    torch.manual_seed(2)
    # Eight live columns spread over the splits; everything else is -inf, so most splits
    # (the second whole) are -inf, and the last split's tail is masked.
    cols = torch.tensor([0, 5, SPLIT_COLUMNS * 2 + 1, 70001, 90000, 120000, 151930, 151935], device="cuda")
    vals = torch.randn(8, device="cuda")
    logits = torch.full((vocab,), float("-inf"), device="cuda")
    logits[cols] = vals
    temps = torch.tensor([0.3, 1.0, 2.0, 0.7], device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        x = logits.to(dtype)
        tokens = gumbel_sample(x.expand(rows, vocab), temps.repeat(rows // 4),
                               torch.arange(rows, device="cuda", dtype=torch.int64) * 31 + 5)
        assert torch.isin(tokens, cols).all()
        for k, t in enumerate(temps.tolist()):
            freq = torch.stack([(tokens[k::4] == c).float().mean() for c in cols])
            assert (freq - torch.softmax(x[cols].float() / t, -1)).abs().max() < 0.015
    # Every column -inf: column 0, as argmax; one live column: that column.
    dead = torch.full((2, vocab), float("-inf"), device="cuda")
    dead[1, 100000] = 0.0
    assert gumbel_sample(dead, torch.ones(2, device="cuda"),
                         torch.tensor([1, 2], device="cuda")).tolist() == [0, 100000]
