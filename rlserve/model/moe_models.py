"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (shared expert), Mixtral, OLMoE.

Each is the Llama-family decoder (llama.py) whose sparse layers take a SparseMoeBlock
(moe.py) for their MLP; layers that transformers keeps dense (mlp_only_layers,
decoder_sparse_step) keep a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

from rlserve.distributed import current_tp_group
from rlserve.model.layers import AttentionMetadata, RMSNorm
from rlserve.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from rlserve.model.moe import ExpertNames, MoEConfig, SparseMoeBlock


class _MoEForCausalLM(LlamaForCausalLM):
    expert_names = ExpertNames()
    renormalize: bool | None = None  # None: the config's norm_topk_prob

    def mlp(self, config, layer: int) -> LlamaMLP | SparseMoeBlock:
        moe = MoEConfig.read(config, self.renormalize)
        if moe.num_experts and moe.is_sparse(layer):
            block = SparseMoeBlock(config, moe, self.expert_names)
            block.layer_index = layer
            return block
        return LlamaMLP(config)


    def activation_width(self) -> int:
        # Each token's k expert rows: gate-up, SiLU-and-mul, and the float32 outputs summed.
        moe = MoEConfig.read(self.config, self.renormalize)
        return max(super().activation_width(),
                   moe.top_k * (3 * moe.intermediate_size + 2 * self.config.hidden_size))


class Qwen3MoeForCausalLM(_MoEForCausalLM):
    qk_norm = True


class Qwen2MoeForCausalLM(_MoEForCausalLM):
    o_bias = False

    def attention(self, config) -> LlamaAttention:
        # transformers 5 reads config.qkv_bias; 4.x always had the bias.
        return LlamaAttention(config, bool(getattr(config, "qkv_bias", True)), False, False)


class MixtralForCausalLM(_MoEForCausalLM):
    expert_names = ExpertNames("w1", "w3", "w2", block="block_sparse_moe")
    renormalize = True  # Mixtral's router always renormalizes its top-k
    # Checkpoints keep Mixtral's router under block_sparse_moe; transformers 5 under mlp.
    checkpoint_spellings = ((".mlp.gate.", ".block_sparse_moe.gate."),)


class OlmoeAttention(LlamaAttention):
    """OLMoE's q/k norms span the whole projection (every head at once), not each head,
    and clip_qkv clamps the projections."""

    q_norm: RMSNorm  # always present here
    k_norm: RMSNorm

    def __init__(self, config):
        super().__init__(config, False, False, qk_norm=False)
        if current_tp_group().world_size > 1:
            raise ValueError("OlmoeForCausalLM: tensor_parallel_size must be 1 (its q/k norms span "
                             "every attention head)")
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def attend(self, positions, hidden, meta: AttentionMetadata):
        qkv = self.qkv_proj(hidden)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.contiguous()).reshape(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k.contiguous()).reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), meta)


class OlmoeForCausalLM(_MoEForCausalLM):
    def attention(self, config) -> LlamaAttention:
        return OlmoeAttention(config)
