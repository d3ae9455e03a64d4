"""Hybrid models on CPU: Qwen3.5 (its text model, and the multimodal checkpoint), Qwen3.5-MoE
and Qwen3-Next against transformers in float32 on small random checkpoints written by
save_pretrained: greedy tokens and logprobs batched and alone, a prompt over several
prefill chunks, forced preemption, a repeated prompt (prefix caching is off for these
models), and both weight-name spellings loading the same bits."""

from __future__ import annotations

import pytest
import torch

from helpers.hybrid import COMMON, MOE, VOCAB, hybrid_model, prompts, text_names
from helpers.oracle import hf_greedy
from rlserve import LLM, SamplingParams

MAX_TOKENS = 32
ARCHS = ["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next"]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    """(arch, directory, transformers' model): a random checkpoint as save_pretrained writes it."""
    hf = hybrid_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, str(path), hf


def engine(path: str, **kw) -> LLM:
    kw = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
              max_num_batched_tokens=64, **kw)
    return LLM(path, **kw)


def greedy(llm: LLM, ids: list[list[int]]):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [x.logprob for x in o.outputs[0].logprobs]) for o in outs]


def assert_transformers(hf, ids: list[list[int]], got, label: str) -> None:
    for prompt, (tokens, logprobs) in zip(ids, got):
        want_tokens, want_logprobs = hf_greedy(hf, prompt, MAX_TOKENS, guess=tokens)
        assert tokens == want_tokens, label
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4, label


def test_greedy_tokens_and_logprobs_equal_transformers_batched_and_alone(checkpoint):
    arch, path, hf = checkpoint
    ids = prompts()
    with engine(path) as llm:
        batched = greedy(llm, ids)
        alone = [greedy(llm, [p])[0] for p in ids]
    assert_transformers(hf, ids, batched, arch)
    assert [t for t, _ in alone] == [t for t, _ in batched], arch
    for (_, a), (_, b) in zip(alone, batched):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, arch


def test_preempted_requests_are_recomputed_to_transformers_tokens(checkpoint):
    """Six sequences of up to 72 tokens in 12 blocks of 16: some are preempted, their state
    slots freed, and recomputed from their prompts."""
    arch, path, hf = checkpoint
    ids = prompts()[:6]
    with engine(path, num_kv_blocks=12, block_size=16) as llm:
        got = greedy(llm, ids)
        assert llm.engine.stats().preemptions_total > 0
        assert llm.engine.kv.states is not None and llm.engine.kv.states.num_free == llm.engine.config.max_num_seqs
    assert_transformers(hf, ids, got, arch)


def test_a_repeated_prompt_gives_the_same_tokens_with_prefix_caching_off(checkpoint):
    """The prefix cache is off for hybrid models (docs/hybrid.md): a prompt seen before is
    computed again, to the same tokens."""
    arch, path, _ = checkpoint
    ids = prompts()[-1:]
    with engine(path, enable_prefix_caching=True) as llm:
        assert not llm.engine.kv.enable_prefix_caching
        first, again = greedy(llm, ids), greedy(llm, ids)
        out = llm.generate([{"prompt_token_ids": ids[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert first == again, arch
    assert out[0].num_cached_tokens == 0


def multimodal_names(named: list) -> list:
    """The same under the multimodal wrapper's spelling (`model.language_model.layers...`)."""
    return [(n if n.startswith(("model.language_model.", "model.visual.", "lm_head")) else
             n.replace("model.", "model.language_model.", 1), t) for n, t in named]


def test_both_spellings_load_the_same_bits(checkpoint):
    """An offline update under the text model's names and one under the multimodal wrapper's
    (with a vision tower, dropped) leave the same parameters, and transformers' tokens."""
    arch, path, hf = checkpoint
    named = text_names([(n, p.detach()) for n, p in hf.named_parameters()])
    tower = [("model.visual.blocks.0.attn.qkv.weight", torch.zeros(96, 32))]
    loaded = {}
    for way, weights in {"text": named, "multimodal": multimodal_names(named) + tower}.items():
        with engine(path, load_format="dummy") as llm:
            llm.update_weights(weights)
            model = llm.engine.executor.local_runner.model
            loaded[way] = {n: p.detach().clone() for n, p in model.named_parameters()}
            tokens = greedy(llm, prompts(2))
    for name, value in loaded["text"].items():
        assert torch.equal(value, loaded["multimodal"][name]), name
    assert_transformers(hf, prompts(2), tokens, arch)


def test_a_multimodal_config_is_served_as_its_text_model_with_the_wrappers_head_tying(tmp_path):
    """Qwen3.5-MoE's multimodal config, read as transformers reads it: the text_config's
    sizes, the wrapper's architecture (its weight names) and the wrapper's tie flag."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig

    from rlserve.model.loader import load_hf_config
    from rlserve.model.registry import model_class
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    Qwen3_5MoeConfig(text_config=dict(COMMON, **MOE), vision_config=vision, tie_word_embeddings=True,
                     architectures=["Qwen3_5MoeForConditionalGeneration"]).save_pretrained(tmp_path)
    cfg = load_hf_config(str(tmp_path))
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.architectures) == (
        VOCAB, 512, ["Qwen3_5MoeForConditionalGeneration"])
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = model.expected_weights()
    assert expected["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"].required
    assert not expected["model.layers.0.linear_attn.in_proj_qkv.weight"].required
    assert expected.skips("model.visual.blocks.0.attn.qkv.weight")
