"""Mixture-of-experts models on CPU: Qwen3-MoE, Qwen2-MoE (shared expert), Mixtral and OLMoE
against transformers in float32 on small random checkpoints; tensor parallelism; both
expert-name layouts (per-expert checkpoint names, transformers 5's stacked tensors) loading
the same bits; LoRA on an MoE model."""

from __future__ import annotations

import pytest
import torch

from helpers.checkpoints import seeded_wide_model
from helpers.moe import ARCHS, moe_config, per_expert
from helpers.oracle import hf_greedy
from rlserve import LLM, SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    """(arch, directory, transformers' float32 model): a random checkpoint as save_pretrained
    writes it, per-expert names on disk."""
    hf = seeded_wide_model(moe_config(request.param)).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, str(path), hf


def prompts(n: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 128, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 24, (n,), generator=g)]


def greedy(llm: LLM, ids: list[list[int]]):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [x.logprob for x in o.outputs[0].logprobs]) for o in outs]


def state(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.engine.executor.local_runner.model.named_parameters()}


def test_greedy_tokens_and_logprobs_equal_transformers(checkpoint):
    arch, path, hf = checkpoint
    with LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512) as llm:
        got = greedy(llm, prompts())
    for ids, (tokens, logprobs) in zip(prompts(), got):
        want_tokens, want_logprobs = hf_greedy(hf, ids, MAX_TOKENS, guess=tokens)
        assert tokens == want_tokens, arch
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4, arch


def test_stacked_and_per_expert_names_load_the_same_bits(checkpoint):
    """A checkpoint's per-expert names, a trainer's stacked ones, and the two mixed (each
    layer its own way) leave the same parameters, bit for bit."""
    arch, path, hf = checkpoint
    named = [(n, p.detach()) for n, p in hf.named_parameters()]
    layer0 = [(n, t) for n, t in named if ".layers.0." in n]
    ways = {"stacked": named, "per expert": list(per_expert(named, arch)),
            "mixed": [*per_expert(layer0, arch), *[(n, t) for n, t in named if ".layers.0." not in n]]}
    loaded = {}
    for way, weights in ways.items():
        with LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
                 load_format="dummy") as llm:
            dummy = state(llm)
            llm.update_weights(weights)
            loaded[way] = state(llm)
            tokens = greedy(llm, prompts(2))
    for name, value in loaded["stacked"].items():
        assert torch.equal(value, loaded["per expert"][name]) and torch.equal(value, loaded["mixed"][name]), name
        assert not torch.equal(value, dummy[name]), name
    assert tokens == greedy_on(path, 2)


def greedy_on(path: str, n: int):
    with LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512) as llm:
        return greedy(llm, prompts(n))


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_tensor_parallel_two_gives_tensor_parallel_one_tokens(arch, tmp_path):
    """Every rank holds every expert's slice of the intermediate dimension and the router whole;
    one all-reduce a layer sums experts and shared expert alike."""
    hf = seeded_wide_model(moe_config(arch)).eval()
    hf.save_pretrained(tmp_path)
    want = greedy_on(str(tmp_path), 4)
    with LLM(str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
             tensor_parallel_size=2) as llm:
        got = greedy(llm, prompts(4))
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y)) < 1e-4


def test_olmoe_refuses_tensor_parallelism(tmp_path):
    seeded_wide_model(moe_config("olmoe")).save_pretrained(tmp_path)
    with pytest.raises(Exception, match="tensor_parallel_size must be 1"):
        LLM(str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
            tensor_parallel_size=2)


def test_lora_adapts_attention_and_refuses_expert_and_router_weights(tmp_path):
    """An adapter on the attention projections serves the merged model's tokens; one on
    experts or the router is refused, naming the modules."""
    import copy
    import json

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from helpers.checkpoints import save_word_tokenizer
    from helpers.lora_adapters import make_adapter
    hf = seeded_wide_model(moe_config("qwen3_moe")).eval()
    hf.save_pretrained(tmp_path / "base")
    save_word_tokenizer(tmp_path / "base", hf.config.vocab_size)
    tok = AutoTokenizer.from_pretrained(tmp_path / "base")
    adapter = make_adapter(copy.deepcopy(hf), tok, str(tmp_path / "attn"), 8, ["q_proj", "v_proj", "o_proj"],
                           seed=1, scale=0.3)
    bad = tmp_path / "experts"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(dict(
        json.loads((tmp_path / "attn" / "adapter_config.json").read_text()), target_modules=["gate_proj", "gate"])))
    # PEFT's own adapter on experts: a plain "down_proj" reaches the stacked expert tensors.
    peft_experts = make_adapter(copy.deepcopy(hf), tok, str(tmp_path / "peft-experts"), 8, ["down_proj"], seed=2)
    lora = {}
    for module, (out, inp) in {"layers.0.mlp.experts.0.gate_proj": (32, 64), "layers.2.mlp.gate": (8, 64)}.items():
        lora[f"base_model.model.model.{module}.lora_A.weight"] = torch.randn(8, inp)
        lora[f"base_model.model.model.{module}.lora_B.weight"] = torch.randn(out, 8)
    save_file(lora, str(bad / "adapter_model.safetensors"))
    with LLM(str(tmp_path / "base"), device="cpu", dtype="float32", max_model_len=512, enable_lora=True,
             max_loras=2, max_lora_rank=8) as llm:
        llm.load_lora_adapter("attn", adapter.path)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for prompt in ("t5 t17 t3 t99", "t1 t2 t3"):
            out = llm.generate([prompt], params, lora_request="attn", use_tqdm=False)[0].outputs[0].token_ids
            merged = copy.deepcopy(adapter.peft_model).merge_and_unload().eval()
            assert out == hf_greedy(merged, tok.encode(prompt), 12)[0]
        with pytest.raises(ValueError, match=r"expert and router weights take no adapters.*"
                                             r"layers\.0\.mlp\.experts\.0\.gate_proj, .*layers\.2\.mlp\.gate"):
            llm.load_lora_adapter("experts", str(bad))
        with pytest.raises(ValueError, match=r"take no adapters.*layers\.0\.mlp\.experts"):
            llm.load_lora_adapter("peft-experts", peft_experts.path)
