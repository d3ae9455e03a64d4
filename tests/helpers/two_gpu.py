"""The two-GPU server tests' model: a small random Llama with the demo model's tokenizer (or
the one RLSERVE_TEST_TOKENIZER names), drawn wide enough that greedy choices are rarely
near-ties, and the trainer's own greedy tokens for vLLM's example prompts."""

from __future__ import annotations

import os

import torch

from helpers.checkpoints import seeded_wide_model
from rlserve import envs

PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]  # examples/rlhf_http.py's


def llama_checkpoint(path) -> str:
    """The random Llama saved at `path`, the tokenizer's files beside it."""
    import shutil

    from transformers import LlamaConfig
    source = envs.RLSERVE_TEST_TOKENIZER.get()
    if source is None:
        from rlserve.model.demo_model import demo_model_path
        source = demo_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), path)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    seeded_wide_model(cfg).save_pretrained(path)
    return str(path)


def trainer_greedy(checkpoint: str) -> dict[str, list[int]]:
    """The trainer's own model (float32, transformers, on cuda:1): 32 greedy ids per prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to("cuda:1").eval()
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids.to("cuda:1")
            gen = hf.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)
            out[p] = gen[0, ids.shape[1]:].tolist()
    del hf
    torch.cuda.empty_cache()
    return out
