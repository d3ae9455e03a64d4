"""Hybrid models on CPU: Qwen3.5 (its text model, and the multimodal checkpoint), Qwen3.5-MoE
and Qwen3-Next against transformers in float32 on small random checkpoints written by
save_pretrained: greedy tokens and logprobs batched and alone, a prompt over several
prefill chunks, forced preemption, prefix-cache hits (a repeated prompt, an extended one,
the samples of one prompt, under preemption), and both weight-name spellings loading the
same bits."""

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


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


def greedy(llm: LLM, ids: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], PARAMS, use_tqdm=False)
    return [_tokens(o) for o in outs]


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


def test_a_prefix_cache_hit_gives_the_tokens_and_logprobs_of_a_miss_and_of_transformers(checkpoint):
    """A prompt seen before, and one that extends it, start their linear-attention layers
    from the state kept at the end of the shared full blocks and their full-attention
    layers from the cached KV: the prefix is not computed again, and the tokens and
    logprobs are those of the miss and of transformers."""
    arch, path, hf = checkpoint
    prompt = prompts()[-1]  # 150 tokens: the state at 144 is kept
    extended = prompt + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    with engine(path) as llm:
        (miss,), (hit,), (longer,) = (llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)
                                      for p in (prompt, prompt, extended))
        stats = llm.engine.stats()
    assert (miss.num_cached_tokens, hit.num_cached_tokens, longer.num_cached_tokens) == (0, 144, 144), arch
    assert stats.prefix_cache_hit_tokens == 288
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids, arch
    assert max(abs(a.logprob - b.logprob) for a, b in zip(hit.outputs[0].logprobs, miss.outputs[0].logprobs)) < 1e-5
    assert_transformers(hf, [prompt, extended], [_tokens(hit), _tokens(longer)], arch)


def test_samples_of_one_prompt_share_its_state_under_preemption(checkpoint):
    """n = 3 samples and prompts sharing 32 tokens, in 14 blocks of 16: samples after the
    first and the later prompts start from a cached state, requests are preempted and
    recomputed, and every one gives transformers' tokens."""
    arch, path, hf = checkpoint
    shared = prompts()[-1][:40]
    ids = [shared + tail for tail in ([], [7, 9, 11], list(range(20, 40)))]
    with engine(path, num_kv_blocks=14, block_size=16) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(
            n=3, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
        stats = llm.engine.stats()
        assert llm.engine.kv.states is not None and llm.engine.kv.states.num_free == llm.engine.config.max_num_seqs
    assert stats.preemptions_total > 0 and stats.prefix_cache_hit_tokens > 0, arch
    assert all(o.num_cached_tokens >= 32 for o in outs), arch
    for prompt, out in zip(ids, outs):
        assert len(out.outputs) == 3 and all(s.token_ids == out.outputs[0].token_ids for s in out.outputs), arch
        assert_transformers(hf, [prompt], [(out.outputs[0].token_ids, [x.logprob for x in out.outputs[0].logprobs])],
                            arch)


def _tokens(out) -> tuple[list[int], list[float]]:
    return out.outputs[0].token_ids, [x.logprob for x in out.outputs[0].logprobs]


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
