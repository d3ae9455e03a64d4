"""`--batch-invariant` on CPU (float32) for the routed experts and LoRA: a tiny Qwen3-MoE's
prompt gives bitwise the same tokens, logprobs and top logprobs alone and inside a batch
whose other prompts change how many tokens each expert and each adapter gets; with an
attention adapter, beside the base model and other adapted prompts, too."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.checkpoints import save_word_tokenizer, seeded_wide_model
from helpers.moe import moe_config
from rlserve import LLM, SamplingParams

MAX_TOKENS = 6
PROBE = [5, 17, 3, 99, 42, 8, 61, 23, 77, 14, 90, 31]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> tuple[str, str]:
    """(the checkpoint's directory, an adapter on its attention projections)."""
    from transformers import AutoTokenizer

    from helpers.lora_adapters import make_adapter
    hf = seeded_wide_model(moe_config("qwen3_moe")).eval()
    path = tmp_path_factory.mktemp("qwen3-moe-invariant")
    hf.save_pretrained(path / "base")
    save_word_tokenizer(path / "base", hf.config.vocab_size)
    tok = AutoTokenizer.from_pretrained(path / "base")
    adapter = make_adapter(copy.deepcopy(hf), tok, str(path / "attn"), 8, ["q_proj", "v_proj", "o_proj"],
                           seed=1, scale=0.3)
    return str(path / "base"), adapter.path


def others(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 128, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 60, (n,), generator=g)]


def outputs(llm: LLM, prompts: list[list[int]], lora_request=None) -> list[tuple]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=lora_request)
    # TokenLogprob: the token's logprob and rank, its alternatives as packed bytes.
    return [(list(c.token_ids), list(c.logprobs)) for c in (o.outputs[0] for o in outs)]


def test_a_moe_prompt_alone_and_in_a_batch_is_bitwise_equal(qwen3_moe):
    path, _ = qwen3_moe
    with LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
             batch_invariant=True) as llm:
        alone = outputs(llm, [PROBE])[0]
        assert outputs(llm, [*others(5), PROBE, *others(11)[5:]])[5] == alone
        assert outputs(llm, [PROBE, *others(3)])[0] == alone


def test_an_adapted_prompt_alone_and_beside_the_base_model_and_adapters_is_bitwise_equal(qwen3_moe):
    path, adapter = qwen3_moe
    with LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
             batch_invariant=True, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        llm.load_lora_adapter("attn", adapter)
        alone = outputs(llm, [PROBE], lora_request="attn")[0]
        batch = [*others(6), PROBE]
        lora = [None, "attn", None, "attn", "attn", None, "attn"]
        assert outputs(llm, batch, lora_request=lora)[6] == alone
        assert outputs(llm, [PROBE])[0] != alone  # the adapter changes the outputs
