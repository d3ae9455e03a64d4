"""The CUDA engine tests' model: a small random Qwen3 checkpoint beside its transformers
model, the prompts they run, and an offline engine with a fixed KV budget."""

from __future__ import annotations

import torch


def random_checkpoint(path, cfg):
    """transformers' model for `cfg` (float32, seed 0, weights N(0, 0.05)) saved at `path`;
    returns (path, the model on CUDA)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    hf.save_pretrained(path)
    return str(path), hf.cuda().eval()


def qwen3_checkpoint(path):
    """A small random Qwen3 checkpoint (GQA, q/k norm, untied head) and its HF model."""
    from transformers import Qwen3Config
    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      architectures=["Qwen3ForCausalLM"])
    return random_checkpoint(path, cfg)


def engine_prompts() -> list[list[int]]:
    """Six prompts of 5 to 300 tokens over the checkpoint's 4096 ids."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (5, 17, 64, 130, 300, 33)]


def cuda_llm(path, dtype, **kw):
    from rlserve import LLM
    # An explicit KV budget: several engines live in one test process.
    return LLM(path, device="cuda", dtype=dtype, skip_tokenizer_init=True, max_model_len=1024,
               kv_cache_memory_bytes=256 << 20, **kw)
