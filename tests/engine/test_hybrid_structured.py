"""Structured outputs on a hybrid model (CPU, float32): a regex and a choice hold on every
sample of a batch that shares its steps with unconstrained requests, whose tokens stay those of
the same requests run without the constrained ones. The grammar's late sampling must leave the
linear-attention layers' per-sequence state as it leaves the paged KV cache."""

from __future__ import annotations

import re

import pytest

from helpers.checkpoints import save_word_tokenizer
from helpers.hybrid import VOCAB, hybrid_model, prompts
from rlserve import LLM, SamplingParams
from rlserve.sampling_params import StructuredOutputsParams

# The word tokenizer's token i is "t<i>" (t0 is the end of sequence).
REGEX = "(t3|t4){6}"
CHOICES = ["t5t6t7", "t9"]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_grammars_hold_beside_free_requests_on_a_hybrid_model(arch, tmp_path):
    hf_model = hybrid_model(arch)
    hf_model.save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path, VOCAB)
    ids = prompts(6)
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    regex = SamplingParams(max_tokens=12, temperature=1.0, seed=1,
                           structured_outputs=StructuredOutputsParams(regex=REGEX))
    choice = SamplingParams(max_tokens=12, temperature=1.0, seed=2,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    with LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=512, max_num_batched_tokens=64) as llm:
        alone = llm.generate([{"prompt_token_ids": p} for p in ids], free, use_tqdm=False)
        mixed = llm.generate([{"prompt_token_ids": p} for p in ids] * 3,
                             [free] * len(ids) + [regex] * len(ids) + [choice] * len(ids), use_tqdm=False)
    for a, m in zip(alone, mixed[:len(ids)]):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
    for m in mixed[len(ids):2 * len(ids)]:
        assert re.fullmatch(REGEX, "".join(f"t{t}" for t in m.outputs[0].token_ids[:6])), m.outputs[0].token_ids
    for m in mixed[2 * len(ids):]:
        tokens = [f"t{t}" for t in m.outputs[0].token_ids if t != 0]
        assert "".join(tokens) in CHOICES, m.outputs[0].token_ids
    # Unconstrained, the same seeds leave the grammar: the masks did the work.
    assert any(not set(a.outputs[0].token_ids) <= {3, 4} for a in alone)
