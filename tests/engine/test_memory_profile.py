"""KV-cache sizing from a measured profile (rlserve/worker/memory_profile.py): the budget
arithmetic on given measurements, the worst steps the profile runs, and the prompt-logprob
slices that keep a long chunk's logits off the device whole."""

from __future__ import annotations

import pytest

from rlserve.memory import GiB, MemoryProfile
from rlserve.worker import logprobs
from rlserve.worker import memory_profile as mp

MAX_MODEL_LEN = 512


def _profile(**kw) -> MemoryProfile:
    base = dict(total=80 * GiB, free=70 * GiB, weights=57 * GiB, activations=3 * GiB, cuda_graphs=GiB // 2,
                non_torch=GiB // 4)
    return MemoryProfile(**(base | kw))


def test_budget_is_the_share_left_after_what_was_measured():
    p = _profile()
    share = int(80 * GiB * 0.9)
    assert mp.kv_cache_budget(p, 0.9) == share - (57 * GiB + 3 * GiB + GiB // 2 + GiB // 4)
    # Every measured part counts against the share, byte for byte.
    assert mp.kv_cache_budget(_profile(activations=4 * GiB), 0.9) == mp.kv_cache_budget(p, 0.9) - GiB
    assert mp.kv_cache_budget(_profile(cuda_graphs=0), 0.9) == mp.kv_cache_budget(p, 0.9) + GiB // 2


def test_budget_is_capped_by_what_the_device_has_free():
    """A colocated trainer holds memory outside this server's share: the KV cache takes what
    is free, less the activations and graphs still to come."""
    p = _profile(free=12 * GiB)
    assert mp.kv_cache_budget(p, 0.9) == 12 * GiB - 3 * GiB - GiB // 2


def test_blocks_from_the_budget_and_a_clear_error_when_none_fit():
    assert mp.kv_cache_blocks(10 * GiB + 5, GiB) == 10
    with pytest.raises(ValueError, match="gpu_memory_utilization.*max_num_batched_tokens"):
        mp.kv_cache_blocks(mp.kv_cache_budget(_profile(weights=75 * GiB), 0.9), 1 << 20)


def test_worst_steps_fill_the_engine_limits():
    limits = mp.WorstSteps(max_num_batched_tokens=1000, max_num_seqs=8, max_model_len=300, max_logprobs=5,
                           capture_graphs=False)
    prefill = mp.worst_prefill(limits, lora_slot=-1)
    lens = [it.num_new_tokens for it in prefill.scheduled]
    assert sum(lens) == prefill.num_batched_tokens == 1000 and max(lens) <= 300
    assert all(it.samples and it.request.sampling_params.prompt_logprobs == 5 for it in prefill.scheduled)
    decode = mp.worst_decode(limits, lora_slot=-1)
    assert len(decode.scheduled) == 8
    assert all(it.num_new_tokens == 1 and it.request.num_tokens == 300 and it.samples for it in decode.scheduled)
    assert all(it.request.sampling_params.logprobs == 5 for it in decode.scheduled)


def test_worst_steps_run_on_the_real_runner(demo_model):
    """The profile's steps (prompt logprobs, a grammar bitmask, penalties, top-k/p, the widest
    logprobs, LoRA) run through the real model runner over a one-block cache."""
    from rlserve import LLM
    llm = LLM(demo_model, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
              max_num_batched_tokens=700, enable_lora=True, max_logprobs=-1)
    runner = llm.engine.executor.local_runner
    runner.free_kv_cache()
    runner.allocate_kv_cache(1)
    mp.run_worst_steps(runner, mp.WorstSteps(700, 4, MAX_MODEL_LEN, -1, capture_graphs=False))


def test_prompt_logprobs_computed_in_slices_match_one_pass(demo_model, monkeypatch):
    """A chunk's prompt logprobs are computed a few rows at a time (memory_profile sizes for
    one slice): the same logprobs, ranks and alternatives as in one pass."""
    from rlserve import LLM, SamplingParams
    llm = LLM(demo_model, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    prompt = "The history of the printing press, from movable type to the rotary press, " * 6
    whole = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    llm.engine.kv.reset_prefix_cache()
    vocab = llm.engine.vocab_size
    monkeypatch.setattr(logprobs, "_PROMPT_LOGITS_ELEMENTS", 7 * vocab)  # 7 rows a slice
    sliced = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert len(sliced) == len(whole) > 7 * 3
    for a, b in zip(whole[1:], sliced[1:]):
        assert (a.token_id, a.rank) == (b.token_id, b.rank)
        # float32 GEMMs over 7 rows and over all of them differ in the last bits
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-4)
