"""Routing replay, offline (CPU, float32): with --enable-return-routed-experts every sample
carries vLLM's routed_experts, int32 [prompt + output - 1, num_hidden_layers, top_k], and
every row equals transformers' own top-k for the same tokens: with and without a
prefix-cache hit, chunked prefill, preemption forced by a small KV cache, n = 4, for the
tiny MoE preset's architecture (Qwen3-MoE with a dense layer) and Qwen2-MoE with its shared
expert. Dense models refuse the request field and start with the flag."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.checkpoints import seeded_wide_model
from helpers.moe import moe_config
from helpers.routes import hf_routes, preset_config
from rlserve import LLM, SamplingParams
from rlserve.sampling_params import InvalidRequestError

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["moe-tiny", "qwen2_moe"])
def checkpoint(request, tmp_path_factory):
    cfg = preset_config() if request.param == "moe-tiny" else moe_config("qwen2_moe")
    hf = seeded_wide_model(cfg).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return str(path), hf


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab, (int(length),), generator=g).tolist()
            for length in torch.randint(5, 40, (n,), generator=g)]


def check_rows(hf, prompt: list[int], out) -> None:
    """Every row of one sample's routes is transformers' top-k for its token."""
    routes = out.routed_experts
    tokens = prompt + list(out.token_ids)
    assert routes is not None and routes.dtype == np.int32
    assert routes.shape == (len(tokens) - 1, hf.config.num_hidden_layers, hf.config.num_experts_per_tok)
    want = hf_routes(hf, tokens[:-1])
    bad = np.argwhere((routes != want).any(axis=(1, 2)))
    assert not len(bad), f"rows {bad.ravel().tolist()} differ: got {routes[bad[0, 0]]}, want {want[bad[0, 0]]}"


def greedy(n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=MAX_TOKENS, temperature=0 if n == 1 else 1.0, seed=3,
                          ignore_eos=True, **kw)


def test_routes_equal_transformers_top_k_with_and_without_a_prefix_hit(checkpoint):
    path, hf = checkpoint
    ids = prompts(6, hf.config.vocab_size)
    with LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256,
             enable_return_routed_experts=True, max_num_batched_tokens=32) as llm:  # chunked prefill
        first = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False)
        assert sum(o.num_cached_tokens for o in again) > 0  # the second pass hits the prefix cache
        for p, a, b in zip(ids, first, again):
            check_rows(hf, p, a.outputs[0])
            check_rows(hf, p, b.outputs[0])
        # n = 4 on one prompt: four samples share its blocks, each has its own rows after them
        many = llm.generate([{"prompt_token_ids": ids[0]}], greedy(n=4), use_tqdm=False)[0]
        assert len({tuple(o.token_ids) for o in many.outputs}) > 1
        for o in many.outputs:
            check_rows(hf, ids[0], o)
        # A request that opts out gets none; the others still do.
        skipped = llm.generate([{"prompt_token_ids": ids[1]}], greedy(return_routed_experts=False),
                               use_tqdm=False)[0]
        assert skipped.outputs[0].routed_experts is None


def test_routes_survive_preemption_and_recompute(checkpoint):
    path, hf = checkpoint
    ids = prompts(8, hf.config.vocab_size)
    # 8 blocks of 16 tokens for 8 sequences of up to 50: most are preempted and recomputed.
    with LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256,
             enable_return_routed_experts=True, num_kv_blocks=8, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(ids, outs):
        check_rows(hf, p, o.outputs[0])


def test_stop_string_cuts_routes_at_the_kept_tokens(checkpoint):
    path, hf = checkpoint
    from helpers.checkpoints import save_word_tokenizer
    save_word_tokenizer(path, hf.config.vocab_size)
    prompt = prompts(1, hf.config.vocab_size)[0]
    with LLM(path, device="cpu", dtype="float32", max_model_len=256, enable_return_routed_experts=True) as llm:
        free = llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False)[0].outputs[0]
        word = f"t{free.token_ids[3]}"  # a stop string on the fourth token
        stopped = llm.generate([{"prompt_token_ids": prompt}], greedy(stop=[word]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 4
    check_rows(hf, prompt, stopped)


def test_dense_model_refuses_the_field_and_starts_with_the_flag(demo_model, caplog):
    with caplog.at_level("WARNING"):
        llm = LLM(demo_model, device="cpu", dtype="float32", max_model_len=128, enable_return_routed_experts=True)
    with llm:
        assert "no mixture-of-experts layers" in caplog.text
        out = llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert out.outputs[0].routed_experts is None
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(["Hello"], SamplingParams(max_tokens=2, return_routed_experts=True), use_tqdm=False)
        assert e.value.param == "return_routed_experts"


def test_moe_model_without_the_flag_returns_none_and_refuses_the_field(checkpoint):
    path, _ = checkpoint
    with LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128) as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(), use_tqdm=False)[0]
        assert out.outputs[0].routed_experts is None
        with pytest.raises(InvalidRequestError, match="--enable-return-routed-experts"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(return_routed_experts=True), use_tqdm=False)


def test_tensor_parallel_two_returns_one_copy_of_the_same_routes(tmp_path):
    """Rank 0 alone captures (the router is replicated): the routes of tensor parallel 2."""
    hf = seeded_wide_model(moe_config("qwen2_moe")).eval()
    hf.save_pretrained(tmp_path)
    ids = prompts(3, hf.config.vocab_size)
    with LLM(str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256,
             enable_return_routed_experts=True, tensor_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False)
    for p, o in zip(ids, outs):
        check_rows(hf, p, o.outputs[0])


def test_lora_on_the_attention_routes_as_the_merged_model(tmp_path):
    """With an adapter on the attention the hidden states change, and with them the routes:
    they are the merged model's top-k; the base model's requests in the same batch keep theirs."""
    import copy

    from transformers import AutoTokenizer

    from helpers.checkpoints import save_word_tokenizer
    from helpers.lora_adapters import make_adapter
    hf = seeded_wide_model(moe_config("qwen3_moe")).eval()
    hf.save_pretrained(tmp_path / "base")
    save_word_tokenizer(tmp_path / "base", hf.config.vocab_size)
    tok = AutoTokenizer.from_pretrained(tmp_path / "base")
    adapter = make_adapter(copy.deepcopy(hf), tok, str(tmp_path / "attn"), 8, ["q_proj", "v_proj", "o_proj"],
                           seed=1, scale=0.3)
    merged = copy.deepcopy(adapter.peft_model).merge_and_unload().eval()
    prompts_ = [[5, 17, 3, 99, 64, 12], [1, 2, 3, 4]]
    with LLM(str(tmp_path / "base"), device="cpu", dtype="float32", max_model_len=256, enable_lora=True,
             max_loras=1, max_lora_rank=8, enable_return_routed_experts=True) as llm:
        llm.load_lora_adapter("attn", adapter.path)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts_ * 2], greedy(),
                            lora_request=["attn", "attn", None, None], use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts_ * 2, outs)):
        check_rows(merged if i < 2 else hf, p, o.outputs[0])


def test_rows_before_a_live_update_are_the_old_weights_and_versions_say_where(tmp_path):
    """A request spanning an update: its tokens' versions split at the update; the rows of
    the tokens computed before it are the old weights' top-k, those after it are not."""
    from rlserve.frontend.output_processor import OutputProcessor, RequestState
    old = seeded_wide_model(moe_config("qwen3_moe")).eval()
    old.save_pretrained(tmp_path)
    torch.manual_seed(5)
    new = [(n, torch.randn_like(p) * 0.1) for n, p in old.named_parameters()]
    prompt = prompts(1, old.config.vocab_size)[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256,
             enable_return_routed_experts=True) as llm:
        engine, processor = llm.engine, OutputProcessor(None)
        processor.routes_expected = True
        state = RequestState("r", None, prompt, params, stream=True)
        processor.add(state)
        for req in engine.make_requests(prompt, params, "r", stream=True):
            engine.add_request(req)
        while len(state.samples[0].token_ids) < 5:
            out = engine.step()
            if out is not None:
                processor.process(out)
        llm.update_weights(new)
        while engine.has_unfinished():
            out = engine.step()
            if out is not None:
                processor.process(out)
    sample = state.output().outputs[0]
    before = sample.token_versions.count(0)
    assert before >= 5 and set(sample.token_versions[before:]) == {1}
    tokens = prompt + sample.token_ids
    want = hf_routes(old, tokens[:-1])
    computed_before = len(prompt) + before - 1  # the last old token went in after the update
    assert np.array_equal(sample.routed_experts[:computed_before], want[:computed_before])
    assert not np.array_equal(sample.routed_experts[computed_before:], want[computed_before:])
