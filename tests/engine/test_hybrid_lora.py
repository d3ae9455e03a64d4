"""LoRA on a hybrid model (CPU, float32): a PEFT adapter on the full-attention layers'
projections (Qwen3.5's q_proj carries the output gate beside the query) serves the greedy
tokens and logprobs of transformers' merged model, beside requests on the base model; an
adapter on a linear-attention projection is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.hybrid import hybrid_model, prompts
from helpers.oracle import hf_greedy
from rlserve import LLM, SamplingParams

MAX_TOKENS = 16


def _adapter(hf, path, targets: list[str]):
    from peft import LoraConfig, get_peft_model
    peft = get_peft_model(copy.deepcopy(hf), LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                        lora_dropout=0.0))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    peft.save_pretrained(path)
    return peft.merge_and_unload().eval()


def _llm(path: str) -> LLM:
    return LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
               enable_lora=True, max_loras=1, max_lora_rank=8)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_an_attention_adapter_serves_the_merged_models_tokens_beside_the_base_model(arch, tmp_path):
    hf = hybrid_model(arch)
    hf.save_pretrained(tmp_path / "base")
    merged = _adapter(hf, tmp_path / "attn", ["q_proj", "k_proj", "v_proj", "o_proj"])
    ids = prompts(4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    with _llm(str(tmp_path / "base")) as llm:
        llm.load_lora_adapter("attn", str(tmp_path / "attn"))
        outs = llm.generate([{"prompt_token_ids": p} for p in ids + ids], params, use_tqdm=False,
                            lora_request=["attn"] * len(ids) + [None] * len(ids))
    for prompt, o, model in zip(ids + ids, outs, [merged] * len(ids) + [hf] * len(ids)):
        tokens = list(o.outputs[0].token_ids)
        want, want_lp = hf_greedy(model, prompt, MAX_TOKENS, guess=tokens)
        assert tokens == want, arch
        assert max(abs(x.logprob - w) for x, w in zip(o.outputs[0].logprobs, want_lp)) < 1e-4, arch
    assert [o.outputs[0].token_ids for o in outs[:4]] != [o.outputs[0].token_ids for o in outs[4:]]


def test_an_adapter_on_a_linear_attention_projection_is_refused_by_name(tmp_path):
    hf = hybrid_model("qwen3_5")
    hf.save_pretrained(tmp_path / "base")
    _adapter(hf, tmp_path / "linear", ["in_proj_qkv"])
    with _llm(str(tmp_path / "base")) as llm:
        with pytest.raises(Exception, match="in_proj_qkv"):
            llm.load_lora_adapter("linear", str(tmp_path / "linear"))
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        assert len(llm.generate([{"prompt_token_ids": prompts(1)[0]}], params)[0].outputs[0].token_ids) == 4
