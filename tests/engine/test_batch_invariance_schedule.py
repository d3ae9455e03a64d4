"""`--batch-invariant` on CPU (float32) against what the scheduler does to a request: preempted
(its KV cache taken back under memory pressure) and recomputed, and split over two
tensor-parallel ranks. Each prompt's tokens, logprobs and top logprobs are bitwise those of
its run alone, on a tiny Qwen3-MoE (routed experts, a dense layer, attention)."""

from __future__ import annotations

import pytest
import torch

from helpers.checkpoints import seeded_wide_model
from helpers.moe import moe_config
from rlserve import LLM, SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3-moe-schedule")
    seeded_wide_model(moe_config("qwen3_moe")).eval().save_pretrained(path)
    return str(path)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(2, 128, (int(length),), generator=g).tolist()
            for length in torch.randint(20, 60, (n,), generator=g)]


def outputs(llm: LLM, batch: list[list[int]]) -> list[tuple]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [(list(c.token_ids), list(c.logprobs)) for c in (o.outputs[0] for o in outs)]


def _llm(path: str, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
               batch_invariant=True, enable_prefix_caching=False, **kw)


def test_preempted_and_recomputed_prompts_are_bitwise_their_runs_alone(qwen3_moe):
    batch = prompts(8)
    with _llm(qwen3_moe) as llm:
        alone = [outputs(llm, [p])[0] for p in batch]
    # 8 prompts of 20-60 tokens, 12 new each, want 17-32 blocks of 16: 12 blocks hold a few.
    with _llm(qwen3_moe, num_kv_blocks=12) as llm:
        together = outputs(llm, batch)
        assert llm.engine.stats().preemptions_total > 0, "the test must preempt"
    assert together == alone


def test_two_tensor_parallel_ranks_keep_a_prompt_bitwise_alone_and_in_a_batch(qwen3_moe):
    batch = prompts(6)
    with _llm(qwen3_moe, tensor_parallel_size=2) as llm:
        alone = outputs(llm, [batch[3]])[0]
        assert outputs(llm, batch)[3] == alone
        assert outputs(llm, batch[3:] + batch[:3])[0] == alone
