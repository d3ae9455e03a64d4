"""PEFT adapters on the demo model for the LoRA tests: random non-zero LoRA weights, saved in
PEFT's format, and the greedy tokens of the merged transformers model (the reference)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from helpers.oracle import hf_greedy

PROMPTS = ["The capital of France is", "Hello, my name is",
           "def fibonacci(n):\n    # returns the n-th Fibonacci number, computed iteratively"]
MAX_TOKENS = 12


@dataclass
class Adapter:
    path: str
    peft_model: object  # the PeftModel (its base is a private copy of the demo model)
    reference: dict[str, list[int]]  # prompt -> greedy tokens of the merged model


def _randomize(peft_model, seed: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def greedy(model, tokenizer, prompt: str, n: int = MAX_TOKENS) -> list[int]:
    """transformers' greedy tokens for a text prompt (helpers.oracle.hf_greedy)."""
    return hf_greedy(model, tokenizer.encode(prompt), n)[0]


def make_adapter(base_model, tokenizer, path: str, r: int, targets: list[str], seed: int,
                 alpha: float | None = None, scale: float = 0.1, **config) -> Adapter:
    """A PEFT LoRA adapter with random weights on a copy of `base_model`, saved at `path`."""
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=targets,
                     lora_dropout=0.0, **config)
    peft_model = get_peft_model(copy.deepcopy(base_model), cfg)
    _randomize(peft_model, seed, scale)
    peft_model.save_pretrained(path)
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    return Adapter(path, peft_model, {p: greedy(merged, tokenizer, p) for p in PROMPTS})


def rerandomize(adapter: Adapter, tokenizer, seed: int, scale: float = 0.1) -> dict[str, list[int]]:
    """New random weights in the adapter's PeftModel (a 'training step'); the merged
    model's greedy tokens for them."""
    _randomize(adapter.peft_model, seed, scale)
    merged = copy.deepcopy(adapter.peft_model).merge_and_unload().eval()
    return {p: greedy(merged, tokenizer, p) for p in PROMPTS}
