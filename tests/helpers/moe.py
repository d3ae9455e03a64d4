"""Small mixture-of-experts configurations (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) for random
checkpoints, and the per-expert checkpoint names of transformers 5's stacked experts."""

from __future__ import annotations

from rlserve.model.moe import ExpertNames, unstack_experts
from rlserve.model.moe_models import MixtralForCausalLM

COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, eos_token_id=0, bos_token_id=1, pad_token_id=0)


def moe_config(arch: str):
    """At least 8 experts, top-2, two MoE layers, and a dense one where the architecture has them."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**COMMON, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, intermediate_size=96, head_dim=16,
                              mlp_only_layers=[1], norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**COMMON, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=48,
                              intermediate_size=96, mlp_only_layers=[1], architectures=["Qwen2MoeForCausalLM"])
    if arch == "mixtral":
        return MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                             intermediate_size=32, architectures=["MixtralForCausalLM"])
    return OlmoeConfig(**COMMON, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                       intermediate_size=32, architectures=["OlmoeForCausalLM"])


ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def per_expert(named, arch: str):
    """The architecture's checkpoint names for transformers 5's stacked experts."""
    return unstack_experts(named, MixtralForCausalLM.expert_names if arch == "mixtral" else ExpertNames())
