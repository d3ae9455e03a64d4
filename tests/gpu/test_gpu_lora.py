"""LoRA adapters on CUDA (Triton LoRA kernels inside CUDA graphs) against transformers + peft:
float32 token equality in a batch mixing two adapters and the base model, bfloat16 logprobs
within tolerance of the merged model's, and a live adapter push over CUDA IPC. Skipped
without a GPU (the Triton kernels against the torch reference: tests/gpu/test_lora_ops.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers.oracle import hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 4096
TARGETS = {8: ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
           16: ["k_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "q_proj"]}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small random Qwen3 checkpoint (GQA, q/k norm, untied head) with a word-level tokenizer."""
    from helpers.checkpoints import random_qwen3_checkpoint
    path = tmp_path_factory.mktemp("qwen3-lora")
    hf = random_qwen3_checkpoint(path, VOCAB, 256, tie_word_embeddings=False)
    return str(path), hf


def _adapter(hf, path, r: int, seed: int):
    """A PEFT adapter with random non-zero weights, saved; and its merged model on the GPU."""
    from peft import LoraConfig, get_peft_model
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS[r],
                                                              lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(path)
    return peft_model, copy.deepcopy(peft_model).merge_and_unload().cuda().eval()


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    _, hf = checkpoint
    root = tmp_path_factory.mktemp("adapters")
    return {f"r{r}": (str(root / f"r{r}"), *_adapter(hf, str(root / f"r{r}"), r, seed=r)) for r in (8, 16)}


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 64, 130, 33)]


def _hf_greedy(model, ids, n=MAX_TOKENS):
    return hf_greedy(model, ids, n)[0]


def _hf_logprobs(model, prompt, tokens, best: bool = False):
    """The model's logprobs of `tokens` after `prompt` (teacher forced, float32); with
    `best`, also the largest logprob at each position."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        lps = model.float()(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    chosen = lps.gather(-1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    return (chosen, lps.max(-1).values) if best else chosen


def _llm(path, dtype, adapters, **kw):
    from rlserve import LLM
    return LLM(path, device="cuda", dtype=dtype, skip_tokenizer_init=True, max_model_len=1024,
               kv_cache_memory_bytes=256 << 20, enable_lora=True, max_loras=2, max_lora_rank=16,
               lora_modules={name: a[0] for name, a in adapters.items()}, **kw)


def test_float32_mixed_adapter_batch_matches_merged_models_in_cuda_graphs(checkpoint, adapters):
    from rlserve import SamplingParams
    path, hf = checkpoint
    base = copy.deepcopy(hf).cuda().eval()
    llm = _llm(path, "float32", adapters)
    try:
        assert llm.engine.executor.local_runner.graphs is not None
        prompts = _prompts()
        jobs = [(p, name) for p in prompts for name in ("r8", None, "r16")]
        outs = llm.generate([p for p, _ in jobs], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                 ignore_eos=True),
                            lora_request=[n for _, n in jobs])
        for (p, name), out in zip(jobs, outs):
            model = base if name is None else adapters[name][2]
            assert out.outputs[0].token_ids == _hf_greedy(model, p), name
    finally:
        llm.shutdown()


def test_bfloat16_adapter_logprobs_within_tolerance_of_the_merged_model(checkpoint, adapters):
    from rlserve import SamplingParams
    path, _ = checkpoint
    llm = _llm(path, "bfloat16", adapters)
    try:
        prompts = _prompts()
        for name in ("r8", "r16"):
            outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                        logprobs=0), lora_request=name)
            merged = adapters[name][2]
            for p, out in zip(prompts, outs):
                o = out.outputs[0]
                ours = torch.tensor([lp.logprob for lp in o.logprobs], device="cuda")
                theirs, best = _hf_logprobs(merged, p, list(o.token_ids), best=True)
                assert (ours - theirs).abs().max() < 0.1, (name, ours, theirs)
                # Each greedy token is the float32 merged model's argmax after the same prefix,
                # or a near-tie that bf16 rounding may break the other way.
                assert (best - theirs).max() < 0.1, (name, best - theirs)
    finally:
        llm.shutdown()


def test_adapter_push_over_ipc_changes_outputs_to_the_new_merged_model(checkpoint, adapters, tmp_path):
    import httpx

    from helpers.servers import start_server, stop_server
    from rlserve.weight_transfer import WeightSyncClient, WeightTransferError
    path, _ = checkpoint
    peft_model = copy.deepcopy(adapters["r16"][1]).cuda()
    server = start_server(path, tmp_path / "server.log", "--device", "cuda", "--dtype", "float32",
                          "--gpu-memory-utilization", "0.3", "--enable-lora", "--max-lora-rank", "16",
                          "--weight-transfer-config", json.dumps({"backend": "ipc"}))
    try:
        sync = WeightSyncClient(server.url, backend="ipc")
        sync.init()

        def tokens(prompt):
            r = httpx.post(f"{server.url}/v1/completions", timeout=120, json=dict(
                model="live", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                return_token_ids=True))
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        prompts = _prompts()[:3]
        sync.push_lora("live", peft_model)
        assert [tokens(p) for p in prompts] == [_hf_greedy(adapters["r16"][2], p) for p in prompts]
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-2.0)
        result = sync.push_lora("live", peft_model)
        merged = copy.deepcopy(peft_model).merge_and_unload().eval()
        assert [tokens(p) for p in prompts] == [_hf_greedy(merged, p) for p in prompts]
        from rlserve.model.peft import peft_adapter_tensors
        config, good = peft_adapter_tensors(peft_model)
        with pytest.raises(WeightTransferError, match="wrong shapes"):
            sync.push_lora("live", [(n, t[:8] if "k_proj.lora_A" in n else t) for n, t in good],
                           lora_config=config)
        assert [tokens(p) for p in prompts] == [_hf_greedy(merged, p) for p in prompts]
        # a warm push reuses the opened handles: a few ms (benchmarks/weight_sync.py --lora measures)
        assert result.transfer_seconds < 1.0
    finally:
        stop_server(server)
