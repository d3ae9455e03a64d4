"""Routing replay's reference: transformers' own top-k experts at every layer, and the moe-tiny
preset's configuration as a small random checkpoint."""

from __future__ import annotations

import numpy as np
import torch


def preset_config():
    """The moe-tiny preset (Qwen3-MoE, 8 experts, top-2, layer 1 dense) with a small vocabulary,
    untied (tied wide random embeddings make a model repeat its input token, and samples alike)."""
    from transformers import Qwen3MoeConfig

    from rlserve.model.presets import PRESETS
    fields = {k: v for k, v in PRESETS["moe-tiny"].items() if k not in ("torch_dtype", "model_type")}
    return Qwen3MoeConfig(**{**fields, "vocab_size": 256, "eos_token_id": 0, "tie_word_embeddings": False})


def hf_routes(hf, token_ids: list[int]) -> np.ndarray:
    """transformers' own top-k at every layer for `token_ids` (one forward pass), as
    [tokens, num_hidden_layers, top_k] with -1 at dense layers."""
    cfg = hf.config
    out = np.full((len(token_ids), cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, dtype=np.int32)
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue

        def record(_module, _args, output, i=i):
            out[:, i] = output[2].cpu().numpy()
        hooks.append(gate.register_forward_hook(record))
    try:
        with torch.no_grad():
            hf(torch.tensor([token_ids]))
    finally:
        for h in hooks:
            h.remove()
    return out
