"""Random LoRA adapters in PEFT's layout, for benchmarks that mix adapters into a workload."""

from __future__ import annotations

import os

import torch


def write_random_adapters(path: str, num: int, rank: int, root: str) -> list[str]:
    """`num` PEFT adapter directories with random weights on every projection of `path`'s
    architecture (Llama / Qwen names)."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    dirs = []
    for i in range(num):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for module, (fan_in, fan_out) in shapes.items():
                name = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 1e-3
        d = os.path.join(root, f"adapter{i}")
        os.makedirs(d, exist_ok=True)
        save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": [m.split(".")[1] for m in shapes]}, f)
        dirs.append(d)
    return dirs
