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

# Hybrid models: Gated DeltaNet linear attention in three of every four layers.
_QWEN3_5_ROPE = dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)
PRESETS.update({
    # Qwen3.5-0.8B's text model (the multimodal checkpoint's text_config, served as
    # Qwen3_5ForCausalLM): 24 layers, 6 of them full attention.
    "qwen3.5-0.8b": dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=1024,
        intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        vocab_size=248320, max_position_embeddings=262144, rope_parameters=_QWEN3_5_ROPE,
        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
        torch_dtype="bfloat16", eos_token_id=248044, bos_token_id=248044),
    # Qwen3-Next-80B-A3B: 512 experts, 10 a token and a shared one, 48 layers (160 GB in
    # bf16: more than one card holds; see the next preset).
    "qwen3-next-80b-a3b": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=2048,
        intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts=512, num_experts_per_tok=10, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        vocab_size=151936, max_position_embeddings=262144, rope_parameters=_QWEN3_5_ROPE,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
        torch_dtype="bfloat16", eos_token_id=151645, bos_token_id=151643),
})
# Its first 12 layers (3 of full attention): every layer as the 80B has it, 41 GB in bf16,
# one card's worth.
PRESETS["qwen3-next-80b-a3b-12l"] = dict(PRESETS["qwen3-next-80b-a3b"], num_hidden_layers=12)
# Its first 4 (one of full attention), 13.6 GB: a trainer's copy and the server's fit one
# 80 GB card together, for the colocated push.
PRESETS["qwen3-next-80b-a3b-4l"] = dict(PRESETS["qwen3-next-80b-a3b"], num_hidden_layers=4)
# For CPU tests: "tiny"'s sizes as Qwen3.5, and as Qwen3-Next (8 experts, top-2).
PRESETS["qwen3.5-tiny"] = dict(
    PRESETS["tiny"], architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", num_hidden_layers=4,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, full_attention_interval=4, rope_parameters=dict(_QWEN3_5_ROPE, rope_theta=10000.0),
    rms_norm_eps=1e-6)
PRESETS["qwen3-next-tiny"] = dict(
    PRESETS["qwen3.5-tiny"], architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
    moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])

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
