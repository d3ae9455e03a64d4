"""`--batch-invariant` on CUDA (bf16): one prompt's greedy tokens and logprobs alone, inside 64
and inside 256 sequences, with CUDA graphs and eager, bitwise equal; SmolLM2 and a
Qwen3-0.6B-shaped random model. And the trainer's forward under rlserve.batch_invariant on the
GPU. Skipped without a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.checkpoints import seeded_wide_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def qwen3_shaped(tmp_path_factory) -> str:
    """Qwen3-0.6B's shapes (28 layers, 16/8 heads of 128, hidden 1024), random weights."""
    from transformers import Qwen3Config

    from helpers.checkpoints import save_word_tokenizer
    path = tmp_path_factory.mktemp("qwen3-0.6b-shaped")
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=4096, tie_word_embeddings=True,
                      architectures=["Qwen3ForCausalLM"], eos_token_id=0)
    seeded_wide_model(cfg).save_pretrained(path)
    save_word_tokenizer(path, cfg.vocab_size)
    return str(path)


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, min(vocab, 30000)) for _ in range(rng.randrange(20, 300))] for _ in range(n)]


def _probe_in(llm, batch_size: int):
    """The probe prompt's tokens, logprobs and prompt logprobs inside a batch of
    `batch_size` prompts (at its middle), on a cold prefix cache."""
    from rlserve import SamplingParams
    vocab = llm.get_tokenizer().vocab_size
    probe, others = _prompts(1, vocab, 0)[0], _prompts(255, vocab, 1)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    llm.reset_prefix_cache()
    batch = others[:batch_size // 2] + [probe] + others[batch_size // 2:batch_size - 1]
    out = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)[batch_size // 2]
    c = out.outputs[0]
    return (list(c.token_ids), [lp.logprob for lp in c.logprobs], [lp.logprob for lp in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("which", ["smollm2", "qwen3-0.6b-shaped"])
def test_one_prompt_alone_in_64_and_in_256_is_bitwise_equal_with_cuda_graphs(which, demo_model, request):
    """Decode steps replay CUDA graphs (a batch of 37 the 48-row one, 11 rows padding): the
    probe's bits alone, in 37, 64 and 256 sequences, and in eager steps, all equal."""
    from rlserve import LLM
    path = demo_model if which == "smollm2" else request.getfixturevalue("qwen3_shaped")
    # A fixed KV cache: the second engine of the test sizes itself beside what the first left in
    # this process's allocator.
    args = dict(device="cuda", dtype="bfloat16", batch_invariant=True, max_model_len=1024,
                kv_cache_memory_bytes=4 << 30)
    llm = LLM(path, **args)
    try:
        assert llm.engine.executor.local_runner.graphs is not None
        alone = _probe_in(llm, 1)
        for size in (37, 64, 256):
            assert _probe_in(llm, size) == alone, size
    finally:
        llm.shutdown()
    eager = LLM(path, enforce_eager=True, **args)
    try:
        assert eager.engine.executor.local_runner.graphs is None
        assert _probe_in(eager, 1) == alone
        assert _probe_in(eager, 64) == alone
    finally:
        eager.shutdown()


def test_trainer_forward_on_the_gpu_gives_the_servers_logprobs(demo_model):
    from transformers import AutoModelForCausalLM

    import rlserve.batch_invariant as rbi
    from rlserve import LLM, SamplingParams
    llm = LLM(demo_model, device="cuda", dtype="bfloat16", batch_invariant=True, max_model_len=1024,
              gpu_memory_utilization=0.3)
    try:
        prompts = _prompts(16, 30000, 2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.bfloat16).cuda().eval()
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        ids = torch.tensor([p + list(c.token_ids)], device="cuda")
        with torch.no_grad(), rbi.enabled():
            lp = model(ids).logits[0].float().log_softmax(-1)
        got = [lp[len(p) - 1 + i, t].item() for i, t in enumerate(c.token_ids)]
        assert got == [lp.logprob for lp in c.logprobs]
