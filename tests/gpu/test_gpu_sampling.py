"""Penalties, logit bias, allow-lists and bad words on CUDA: the sampler against the torch
reference on the same logits (both paths: the fused Gumbel-max kernel and torch's), and the
engine (Triton kernels, CUDA graphs, overlapped scheduling) against transformers. Skipped
without a GPU."""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_engine import cuda_llm, engine_prompts, qwen3_checkpoint
from helpers.sampling_reference import check_outputs, check_sample_frequencies, check_sampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return qwen3_checkpoint(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def processed(checkpoint):
    return cuda_llm(checkpoint[0], "float32", logprobs_mode="processed_logprobs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_flight, bitmask", [(False, False), (True, False), (True, True)])
def test_sampler_matches_the_reference(processed, dtype, in_flight, bitmask):
    """Penalties, bias, allow-lists, bad words (their newest token still in flight) and
    grammar bitmasks, against the reference on the same logits."""
    runner = processed.engine.executor.local_runner
    assert runner.fused_sampling
    check_sampler(runner, dtype, in_flight, bitmask)


@pytest.mark.parametrize("kw", [{}, {"top_k": 6}], ids=["fused", "torch"])
def test_seeded_samples_follow_the_processed_distribution(processed, kw):
    """Temperature alone takes the fused Gumbel-max kernel on the processed logits; top-k
    takes torch's sort."""
    check_sample_frequencies(processed.engine.executor.local_runner, num_samples=16384, **kw)


def test_engine_matches_transformers(processed, checkpoint):
    from rlserve import SamplingParams
    path, hf = checkpoint
    assert processed.engine.async_scheduling and processed.engine.executor.local_runner.graphs is not None
    prompts = engine_prompts()
    g = torch.Generator().manual_seed(3)
    some = torch.randint(0, 4096, (8,), generator=g).tolist()
    base = dict(max_tokens=24, logprobs=4, ignore_eos=True)
    params = [SamplingParams(temperature=0, repetition_penalty=1.4, **base),
              SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=1.0, **base),
              SamplingParams(temperature=0, logit_bias={some[0]: 6.0, some[1]: -100}, **base),
              SamplingParams(temperature=0, allowed_token_ids=some, **base),
              SamplingParams(temperature=0.8, seed=1, repetition_penalty=1.2, presence_penalty=0.5,
                             bad_words_token_ids=[[some[2]], [some[3], some[4]]], **base),
              SamplingParams(temperature=1.0, seed=2, top_k=50, frequency_penalty=0.7,
                             logit_bias={some[5]: 3.0}, **base)]
    outs = processed.generate(prompts, params)
    check_outputs(processed, hf, params, outs, processed=True)


def test_logprob_token_ids_in_a_mixed_batch(processed):
    """Rows asking for chosen tokens' logprobs beside rows asking for the top k: each gets
    what it asked for, the chosen ids' values equal to what the top 20 say of them."""
    from rlserve import SamplingParams
    prompts = engine_prompts()[:3]
    base = dict(temperature=0, max_tokens=12, ignore_eos=True)
    ref = processed.generate(prompts, SamplingParams(logprobs=20, **base), use_tqdm=False)
    wanted = [[t for t, _ in o.outputs[0].logprobs[0].top.head(20)][::-4] for o in ref]
    params = [SamplingParams(logprobs=0, logprob_token_ids=wanted[0], **base),
              SamplingParams(logprobs=2, **base),
              SamplingParams(logprob_token_ids=wanted[2], **base)]
    outs = processed.generate(prompts, params, use_tqdm=False)
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out.outputs[0].token_ids == r.outputs[0].token_ids
        for got, top in zip(out.outputs[0].logprobs, r.outputs[0].logprobs):
            assert got.rank == top.rank and got.logprob == pytest.approx(top.logprob, abs=1e-4)
            if i == 1:
                assert [v for _, v in got.top] == pytest.approx([v for _, v in top.top.head(2)], abs=1e-4)
                continue
            assert [t for t, _ in got.top] == wanted[i]
            known = dict(top.top.head(20))
            for t, v in got.top:
                if t in known:
                    assert v == pytest.approx(known[t], abs=1e-4)
