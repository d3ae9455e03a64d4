"""Engine core against transformers on the same weights, and the scheduler's invariants."""

from __future__ import annotations

import shutil

import pytest
import torch

from helpers.oracle import hf_greedy
from rlserve import LLM, SamplingParams
from rlserve.model.demo_model import demo_model_path
from rlserve.sampling_params import InvalidRequestError

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Hello, my name is",
    "List three primary colors:",
    "The future of AI is",
    "1, 2, 3, 4,",
    "Translate to French: good morning",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def model_path() -> str:
    return demo_model_path()


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(model_path, device="cpu", dtype="float32", max_model_len=512)


def test_smollm2_greedy_matches_transformers(llm, hf_demo):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        sample = out.outputs[0]
        ref_tokens, ref_lps = hf_greedy(hf_demo, ids, 32, guess=sample.token_ids)
        assert sample.token_ids == ref_tokens, prompt
        ours = [lp.logprob for lp in sample.logprobs]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-4
        assert sample.text == llm.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        assert sample.finish_reason == "length"
        assert all(lp.rank == 1 for lp in sample.logprobs)  # greedy picks the top token
        assert all(len(lp.top) == 1 for lp in sample.logprobs)


def test_prompt_logprobs_match_transformers(llm, hf_demo):
    ids = llm.tokenizer.encode(PROMPTS[-1])
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    with torch.no_grad():
        logits = hf_demo(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        lp = out.prompt_logprobs[pos]
        assert lp.token_id == ids[pos]
        assert abs(lp.logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert len(lp.top) == 2


def _tiny_checkpoint(tmp_path, model_path, config):
    """Random weights for `config` saved as an HF directory, with the demo tokenizer."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger than the default init, so the logits are far from ties
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    hf.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_path}/{f}", tmp_path)
    return hf


def _tiny_configs():
    from transformers import OPTConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256)
    return {
        "qwen3": Qwen3Config(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, **common),
        "qwen2": Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common),
        "opt": OPTConfig(vocab_size=49152, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64),
        "opt-project": OPTConfig(vocab_size=49152, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=256,
                                 word_embed_proj_dim=32),
    }


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "opt", "opt-project"])
def test_small_architectures_match_transformers(arch, tmp_path, model_path):
    config = _tiny_configs()[arch]
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    hf = _tiny_checkpoint(tmp_path, model_path, config)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    prompts = [[5, 17, 300, 42, 9, 11], [1000, 2000, 3000], list(range(100, 140))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        ref, _ = hf_greedy(hf, ids, 16, guess=out.outputs[0].token_ids)
        assert out.outputs[0].token_ids == ref, arch


def test_prefix_cache_hit_gives_same_tokens(llm):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    long_prompt = PROMPTS[7] * 6  # several full blocks
    llm.reset_prefix_cache()
    first = llm.generate([long_prompt], params)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate([long_prompt], params)[0]
    assert second.num_cached_tokens >= 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


# Six sequences of ~50 tokens: 12 blocks of 16 tokens cannot hold them, so preemption is forced.
PREEMPTED = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def unconstrained(llm) -> list[list[int]]:
    """The greedy tokens of PROMPTS[:6] from an engine with room for all of them."""
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], PREEMPTED)]


def test_preempted_requests_recompute_to_same_tokens(model_path, llm, unconstrained):
    small = LLM(model_path, device="cpu", dtype="float32", num_kv_blocks=12, max_model_len=512)
    outs = small.generate(PROMPTS[:6], PREEMPTED)
    assert small.engine.stats().preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == unconstrained
    alone = [llm.generate([p], PREEMPTED)[0].outputs[0].token_ids for p in PROMPTS[:2]]
    assert alone == unconstrained[:2]


def test_chunked_prefill_gives_same_tokens(model_path, llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = " ".join(PROMPTS)
    plain = llm.generate([prompt], params)[0].outputs[0].token_ids
    chunked = LLM(model_path, device="cpu", dtype="float32", max_num_batched_tokens=16,
                  enable_prefix_caching=False, max_model_len=512)
    assert chunked.generate([prompt], params)[0].outputs[0].token_ids == plain


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=12,
                            ignore_eos=True, logprobs=0)
    alone = llm.generate([PROMPTS[0]], params)[0]
    again = llm.generate([PROMPTS[0]], params)[0]
    crowded = llm.generate(PROMPTS[:5], [params] + [SamplingParams(temperature=0.7, max_tokens=20)] * 4)[0]
    samples = [o.token_ids for o in alone.outputs]
    assert len(samples) == 4
    assert samples == [o.token_ids for o in again.outputs]
    assert samples == [o.token_ids for o in crowded.outputs]
    assert len({tuple(s) for s in samples}) > 1  # the four samples differ
    # The raw-distribution logprob of each sampled token is a real log-probability.
    assert all(lp.logprob <= 0 for o in alone.outputs for lp in o.logprobs)


def test_stop_strings_and_stop_tokens(llm):
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=32, temperature=0, stop=["return"]))[0]
    sample = out.outputs[0]
    assert sample.finish_reason == "stop" and sample.stop_reason == "return"
    assert "return" not in sample.text
    free = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=32, temperature=0))[0].outputs[0]
    stop_tok = free.token_ids[3]
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=32, temperature=0,
                                                    stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:4] and out.stop_reason == stop_tok
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=32, temperature=0, min_tokens=8,
                                                    stop_token_ids=[stop_tok]))[0].outputs[0]
    assert len(out.token_ids) >= 8


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(max_tokens=16, temperature=0))[0]
    assert "Paris" in out.outputs[0].text


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field


def test_logprobs_beyond_max_logprobs_are_refused(llm):
    """Any count is a valid SamplingParams (-1: the whole vocabulary, as in vLLM); the engine
    refuses more than its max_logprobs (20 by default), naming the field and the limit."""
    for kwargs, field in [(dict(logprobs=50), "logprobs"), (dict(logprobs=-1), "logprobs"),
                          (dict(prompt_logprobs=21), "prompt_logprobs")]:
        with pytest.raises(InvalidRequestError, match=r"--max-logprobs \(20\)") as e:
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, **kwargs))
        assert e.value.param == field
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, logprobs=20))[0].outputs[0].logprobs


def test_prompt_longer_than_max_model_len_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="max_model_len is 512"):
        llm.generate([[1] * 600], SamplingParams(max_tokens=4))
    # Nothing was left behind: the engine still serves.
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_unsupported_architecture_lists_the_supported(tmp_path, model_path):
    import json
    shutil.copytree(model_path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg["model_type"] = "gpt_neox"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture GPTNeoXForCausalLM; supported: .*LlamaForCausalLM"):
        LLM(str(tmp_path / "m"), device="cpu", load_format="dummy")


LONG_TEXT = ("Group relative policy optimisation samples several completions for each prompt, "
             "scores them, and uses the group's mean and standard deviation as the baseline. "
             "The server that generates these rollouts receives new weights after every "
             "training step, without a restart, so the samples come from the current policy. ") * 3


def test_fp8_kv_cache_holds_more_tokens_and_stays_close(model_path, llm):
    """kv_cache_dtype="fp8": a byte per element and a float32 scale per head row, so one
    budget holds 3.8x the blocks of a float32 cache (SmolLM2: head_dim 64); prompt
    logprobs, whose keys are read back from the cache, stay close to the float32 cache's
    (benchmarks/kv_cache_precision.py: 0.05 nats on average; bf16 weights alone 0.03)."""
    budget = 16 << 20
    base = LLM(model_path, device="cpu", dtype="float32", max_model_len=512,
               kv_cache_memory_bytes=budget)
    fp8 = LLM(model_path, device="cpu", dtype="float32", max_model_len=512,
              kv_cache_memory_bytes=budget, kv_cache_dtype="fp8")
    runner = fp8.engine.executor.local_runner
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    assert runner.kv_scales.shape == (*runner.kv_cache.shape[:-1],)
    runners = [e.engine.executor.local_runner for e in (base, fp8)]
    rows = 2 * 16 * 3 * 30  # k and v, block size, kv heads, layers
    assert [r.kv_bytes_per_block() for r in runners] == [rows * 64 * 4, rows * (64 + 4)]
    assert [r.num_blocks for r in runners] == [budget // r.kv_bytes_per_block() for r in runners]

    ids = fp8.tokenizer.encode(LONG_TEXT)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    ours, theirs = (torch.tensor([lp.logprob for lp in e.generate([ids], params)[0].prompt_logprobs[1:]])
                    for e in (fp8, base))
    assert (ours - theirs).abs().mean() < 0.1
    assert (ours - theirs).abs().max() < 1.5
    # Greedy decoding reads its prompt back from fp8 blocks, also through the prefix cache.
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first, again = (fp8.generate([ids], greedy)[0] for _ in range(2))
    assert again.num_cached_tokens > 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def test_kv_cache_dtype_is_checked(model_path):
    with pytest.raises(ValueError, match="kv_cache_dtype: unsupported 'int8'; choose one of auto"):
        LLM(model_path, device="cpu", kv_cache_dtype="int8")


def test_unknown_load_format_is_refused(model_path):
    with pytest.raises(ValueError, match="load_format"):
        LLM(model_path, device="cpu", load_format="gguf-magic")


def test_dummy_weights_are_deterministic(model_path):
    a = LLM(model_path, device="cpu", load_format="dummy", seed=3, max_model_len=128)
    b = LLM(model_path, device="cpu", load_format="dummy", seed=3, max_model_len=128)
    pa = dict(a.engine.executor.local_runner.model.named_parameters())
    for name, p in b.engine.executor.local_runner.model.named_parameters():
        assert torch.equal(p, pa[name]), name


def test_overlapped_scheduling_gives_the_same_outputs(model_path):
    """CUDA runs overlap step N+1 with reading back step N; here the same logic runs on CPU
    (greedy, seeded n > 1, stop strings, min_tokens, prompt logprobs, and preemption)."""
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1),
              SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12),
              SamplingParams(max_tokens=30, temperature=0, stop=["coach"]),
              SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1),
              SamplingParams(max_tokens=25, temperature=0.8, seed=9, min_tokens=5)]

    def run(**kw):
        llm = LLM(model_path, device="cpu", dtype="float32", max_model_len=256, **kw)
        outs = llm.generate(PROMPTS[:5], params)
        return [([(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in r.outputs],
                 [round(lp.logprob, 4) for o in r.outputs for lp in (o.logprobs or [])],
                 [round(lp.logprob, 4) if lp else None for lp in (r.prompt_logprobs or [])])
                for r in outs], llm.engine.stats().preemptions_total

    plain, _ = run(async_scheduling=False)
    overlapped, _ = run(async_scheduling=True)
    assert overlapped == plain
    tight, preemptions = run(async_scheduling=True, num_kv_blocks=6)
    assert preemptions > 0
    assert [r[0] for r in tight] == [r[0] for r in plain]  # recompute may move a logprob by 1e-5


def _check_block_tables(kv, reqs) -> None:
    """The KV manager's block-table array (written as blocks are added) holds each
    request's block list, 0-padded, and rows no request holds are all 0."""
    from rlserve.worker.step_inputs import table_array
    table = kv.block_table_array(reqs)
    lists = [kv.block_table(r) for r in reqs]
    assert table.shape == (len(reqs), max(map(len, lists)))
    for row, blocks in zip(table.tolist(), lists):
        assert row == blocks + [0] * (table.shape[1] - len(blocks))
    # Other ranks get the lists in their step messages: the runner packs them the same way.
    assert (table_array(lists) == table).all()
    unused = sorted(set(range(kv.tables.array.shape[0])) - set(kv.rows.values()))
    assert not kv.tables.array[unused].any()


def test_block_table_array_follows_allocation_preemption_and_prefix_hits():
    from rlserve.engine.kv_cache import KVCacheManager
    from rlserve.engine.request import Request
    bs = 4
    kv = KVCacheManager(num_blocks=400, block_size=bs, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=300)
    # More requests and more blocks per request than the array starts with: it grows.
    reqs = [Request(f"r{i}", [i % 7 + 1] * (bs * (i % 3) + 3), params, max_model_len=1024)
            for i in range(70)]
    for r in reqs:
        assert kv.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        kv.cache_computed_blocks(r)
    _check_block_tables(kv, reqs)
    long = reqs[0]
    long.token_ids.extend(range(100, 100 + 70 * bs))  # 70 more blocks, a few at a time
    while long.num_computed_tokens < long.num_tokens:
        assert kv.allocate(long, 3)
        long.num_computed_tokens += 3
    assert len(kv.block_table(long)) > 64
    _check_block_tables(kv, reqs)
    # Preempt (free) every other request; rows are cleared and reused by later ones.
    for r in reqs[1::2]:
        kv.free(r)
        r.num_computed_tokens = 0
    _check_block_tables(kv, reqs[::2])
    again = []
    for r in reqs[1::2]:  # recomputed: their full prompt blocks come from the prefix cache
        cached = kv.find_cached_prefix(r)
        assert kv.allocate(r, r.num_tokens - len(cached) * bs, cached)
        assert kv.block_table(r)[:len(cached)] == cached
        again.append(r)
    assert any(kv.find_cached_prefix(r) for r in again)
    _check_block_tables(kv, reqs)
    for r in reqs:
        kv.free(r)
    assert not kv.tables.array.any() and kv.pool.num_free == 400


def test_block_tables_through_engine_preemption(model_path, unconstrained):
    """Step by step through forced preemption: the table the runner gets is the
    requests' block lists, and the tokens match an unconstrained engine's."""
    small = LLM(model_path, device="cpu", dtype="float32", num_kv_blocks=12, max_model_len=512,
                async_scheduling=True)
    engine = small.engine
    tables_seen = []
    launch = engine.executor.local_runner.launch

    def checked_launch(sched, block_tables, prev=None, **kw):
        reqs = [item.request for item in sched.scheduled]
        _check_block_tables(engine.kv, reqs)
        tables_seen.append(block_tables.shape)
        return launch(sched, block_tables, prev, **kw)

    engine.executor.local_runner.launch = checked_launch
    outs = small.generate(PROMPTS[:6], PREEMPTED)
    assert engine.stats().preemptions_total > 0 and tables_seen
    assert [o.outputs[0].token_ids for o in outs] == unconstrained


@pytest.mark.parametrize("overlapped", [False, True])
def test_streamed_and_whole_outputs_agree(llm, overlapped):
    """The engine reports a streamed request's tokens every step, a non-streamed one's
    once when it finishes. Both assemble to the same results."""
    params = [SamplingParams(max_tokens=20, temperature=0, logprobs=2, prompt_logprobs=1),
              SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=16, stop=["return"]),
              SamplingParams(max_tokens=24, temperature=0, min_tokens=4, stop_token_ids=[28, 30]),
              SamplingParams(max_tokens=12, temperature=0.7, seed=4, ignore_eos=True, logprobs=0)]

    def run(stream: bool):
        llm.reset_prefix_cache()
        llm._report_every_step, llm.engine.async_scheduling = stream, overlapped
        try:
            outs = llm.generate(PROMPTS[:4], params)
        finally:
            llm._report_every_step, llm.engine.async_scheduling = False, False
        return [(o.prompt_logprobs, o.num_cached_tokens, o.finished,
                 [(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, c.token_versions)
                  for c in o.outputs]) for o in outs]

    whole = run(stream=False)
    assert run(stream=True) == whole
    reasons = [c[3] for o in whole for c in o[3]]
    assert "stop" in reasons and "length" in reasons, reasons


def test_step_upload_keeps_dtypes_shapes_and_alignment():
    """One upload carries the whole step; every part comes back with its dtype and shape,
    starting 64-byte aligned as a fresh tensor does (Triton compiles per pointer alignment)."""
    import numpy as np

    from rlserve.worker.upload import upload
    parts = [np.arange(257, dtype=np.int64), np.arange(3, dtype=np.int32), np.empty(0, dtype=np.int64),
             np.arange(12, dtype=np.int32).reshape(3, 4), np.array([0.5, 1.5, 2.5], dtype=np.float32)]
    dtypes = [torch.int64, torch.int32, torch.int64, torch.int32, torch.float32]
    for a, t, dtype in zip(parts, upload(parts, torch.device("cpu")), dtypes):
        assert t.dtype == dtype and tuple(t.shape) == a.shape and (t.numpy() == a).all()
        assert t.data_ptr() % 64 == 0


# -- prefix-cache keys: a hit is verified, salts isolate -------------------------------

def _kv_prefill(kv, req) -> list[int]:
    """Admit `req` as the scheduler does (prefix lookup, allocate), compute its prompt and
    register its full blocks; the prefix-cache hits it got."""
    cached = kv.find_cached_prefix(req)
    assert kv.allocate(req, req.num_tokens - len(cached) * kv.block_size, cached)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return cached


def _kv_request(rid: str, tokens: list[int], salt: str | None = None):
    from rlserve.engine.request import Request
    return Request(rid, tokens, SamplingParams(max_tokens=8), max_model_len=1024, cache_salt=salt)


@pytest.mark.parametrize("forced_key", ["constant", "tokens_only"])
def test_prefix_key_collision_never_serves_another_prompts_blocks(monkeypatch, forced_key):
    """Keys forced to collide: every prompt's blocks under one key, or a block's key blind to
    what came before it. A lookup finds only blocks holding its own tokens after its own
    prefix, or nothing."""
    from rlserve.engine import kv_cache
    from rlserve.engine.kv_cache import KVCacheManager
    if forced_key == "constant":
        monkeypatch.setattr(kv_cache, "block_key", lambda parent, token_bytes: b"same")
    else:
        monkeypatch.setattr(kv_cache, "block_key", lambda parent, token_bytes: token_bytes)
    bs = 4
    kv = KVCacheManager(num_blocks=64, block_size=bs, enable_prefix_caching=True)
    a, b, c = [1] * bs, [2] * bs, [3] * bs
    z = _kv_request("z", c + b + [9])  # blocks [c, b]: b's key (tokens only) is also x's
    x = _kv_request("x", a + b + [9])  # blocks [a, b]
    assert _kv_prefill(kv, z) == []
    assert _kv_prefill(kv, x) == []
    for rid, prompt, want in [("w", a + b + [5], kv.block_table(x)[:1]),  # x's first block only
                              ("y", b + b + [5], []),
                              ("v", c + [7] * bs + [5], kv.block_table(z)[:1])]:
        hits = kv.find_cached_prefix(_kv_request(rid, prompt))
        if forced_key == "constant":  # one key: only z's first block is cached at all
            want = kv.block_table(z)[:1] if prompt[:bs] == c else []
        assert hits == want, (rid, hits, want)
        for i, block in enumerate(hits):  # whatever hit holds exactly these tokens
            owner = x if block in kv.block_table(x) else z
            assert owner.token_ids[:(i + 1) * bs] == prompt[:(i + 1) * bs]


def test_prefix_cache_salts_isolate_and_same_salt_hits():
    from rlserve.engine.kv_cache import KVCacheManager
    bs = 4
    kv = KVCacheManager(num_blocks=64, block_size=bs, enable_prefix_caching=True)
    prompt = list(range(1, 3 * bs + 2))  # three full blocks and one more token
    assert _kv_prefill(kv, _kv_request("t1", prompt, "tenant-1")) == []
    assert kv.find_cached_prefix(_kv_request("t2", prompt, "tenant-2")) == []
    assert kv.find_cached_prefix(_kv_request("none", prompt)) == []
    again = _kv_request("t1-again", prompt, "tenant-1")
    assert len(_kv_prefill(kv, again)) == 3
    # And the other way: unsalted blocks are not served to a salted request.
    assert _kv_prefill(kv, _kv_request("u", prompt)) == []
    assert kv.find_cached_prefix(_kv_request("t3", prompt, "tenant-3")) == []
    assert len(kv.find_cached_prefix(_kv_request("u-again", prompt))) == 3


def test_prefix_cache_chains_through_a_duplicate_block():
    """Two requests computed the same prompt at once (only the first one's blocks are
    cached); the second's later blocks are still found after the first's."""
    from rlserve.engine.kv_cache import KVCacheManager
    bs = 4
    kv = KVCacheManager(num_blocks=64, block_size=bs, enable_prefix_caching=True)
    prompt = list(range(1, 2 * bs + 2))
    first, second = _kv_request("a", prompt), _kv_request("b", prompt)
    for r in (first, second):  # both admitted before either registered a block
        assert kv.allocate(r, r.num_tokens)
    for r in (first, second):
        r.num_computed_tokens = r.num_tokens
        kv.cache_computed_blocks(r)
    second.token_ids.extend([50] * bs)  # its own output fills block 2
    assert kv.allocate(second, bs)
    second.num_computed_tokens = second.num_tokens
    kv.cache_computed_blocks(second)
    hits = kv.find_cached_prefix(_kv_request("c", second.token_ids + [1]))
    assert hits == kv.block_table(first)[:2] + kv.block_table(second)[2:3]


def test_cache_salt_through_the_engine(llm, monkeypatch):
    """Offline API: the same salt and prompt hit, another salt (or none) does not; with every
    key forced equal, outputs are those of an uncached run."""
    from rlserve.engine import kv_cache
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = PROMPTS[7] * 4  # two full blocks and more
    others = [PROMPTS[5] * 4, PROMPTS[1] * 4]
    llm.reset_prefix_cache()
    first = llm.generate([prompt], params, cache_salt="tenant-a")[0]
    same = llm.generate([prompt], params, cache_salt="tenant-a")[0]
    other = llm.generate([prompt], params, cache_salt="tenant-b")[0]
    unsalted, *uncached = llm.generate([prompt, *others], params)
    assert first.num_cached_tokens == 0 and same.num_cached_tokens == 32
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert same.outputs[0].token_ids == other.outputs[0].token_ids == first.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        llm.generate([prompt], params, cache_salt="")

    llm.reset_prefix_cache()
    monkeypatch.setattr(kv_cache, "block_key", lambda parent, token_bytes: b"same")
    llm.generate([prompt], params)
    collided = llm.generate(others, params)
    assert all(o.num_cached_tokens == 0 for o in collided)
    assert [o.outputs[0].token_ids for o in collided] == [o.outputs[0].token_ids for o in uncached]
    llm.reset_prefix_cache()
