"""Published architectures by name, for benchmarks and tests: a config alone, weights dummy."""

from __future__ import annotations

import json
import os
import tempfile

PRESETS = {
    # The published configs of these architectures; weights are dummy.
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
        attention_bias=False, torch_dtype="bfloat16", eos_token_id=151645, bos_token_id=151643),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        attention_bias=False, mlp_bias=False, torch_dtype="bfloat16", eos_token_id=128001,
        bos_token_id=128000),
    # Two layers, hidden 128, SmolLM2's vocabulary: a model whose step costs almost nothing,
    # so what is measured is the serving path around it (CPU).
    "tiny": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        attention_bias=False, mlp_bias=False, torch_dtype="float32", eos_token_id=2,
        bos_token_id=1),
    # Qwen3's mixture of experts: 128 experts, 8 a token, 3.3B of its 30.5B parameters active.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16",
        eos_token_id=151645, bos_token_id=151643),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
        attention_bias=False, torch_dtype="bfloat16", eos_token_id=151645, bos_token_id=151643),
}

# "tiny" as a mixture of experts (8 experts, top-2; layer 1 dense), for CPU tests.
PRESETS["moe-tiny"] = dict(
    PRESETS["tiny"], architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
    moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3, rms_norm_eps=1e-6)


def model_dir(name: str) -> str:
    """A preset becomes a directory holding only its config.json (serve it with
    load_format "dummy"); `smollm2` is the demo model; anything else is returned as is."""
    if name == "smollm2":
        from rlserve.model.demo_model import demo_model_path
        return demo_model_path()
    if name not in PRESETS:
        return name
    path = os.path.join(tempfile.gettempdir(), f"rlserve-preset-{name}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(PRESETS[name], f)
    return path
