"""Llama-family decoders: Llama 2/3 (SmolLM2, Mistral), Qwen2 (qkv bias), Qwen3 (q/k norm)."""

from __future__ import annotations

from torch import nn

from rlserve.distributed import current_tp_group, partition_heads, split_evenly
from rlserve.model.base import CausalLM
from rlserve.model.layers import (
    AttentionMetadata,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    act_and_mul,
    fuse_rope_and_store,
    linear_add_norm,
)
from rlserve.model.moe import SparseMoeBlock
from rlserve.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)
from rlserve.ops.kernels import TORCH, Kernels


def _rope(config) -> tuple[float, dict | None]:
    # transformers 5 keeps theta inside rope_parameters; 4.x had rope_theta + rope_scaling.
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or (params if params else None)
    return theta, scaling


class LlamaAttention(nn.Module):
    """This rank's attention heads (all of them on one rank; see partition_heads)."""

    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        tp = current_tp_group()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        heads = partition_heads(total_heads, total_kv_heads, tp.world_size, tp.rank)
        self.num_heads, self.num_kv_heads = heads.num_q, heads.num_kv
        d = self.head_dim
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        q = Shard(0, heads.q_start * d, self.q_size, total_heads * d)
        kv = Shard(0, heads.kv_start * d, self.kv_size, total_kv_heads * d)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q, kv, kv], bias=qkv_bias)
        self.o_proj = RowParallelLinear(q, config.hidden_size, bias=o_bias)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        theta, scaling = _rope(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, positions, hidden, meta: AttentionMetadata):
        return self.o_proj(self.attend(positions, hidden, meta))

    def attend(self, positions, hidden, meta: AttentionMetadata):
        """The attention heads' output, before o_proj."""
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        # Where it can, the rotary kernel also writes k/v to the cache: one launch fewer per layer.
        fused = fuse_rope_and_store(q, self.attn)
        if fused:
            self.rotary_emb.forward_and_store(positions, q, k, v, self.attn, meta.slot_mapping,
                                              self.q_norm, self.k_norm)
        else:
            q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        return self.attn(q, k, v, meta, stored=fused)


class LlamaMLP(nn.Module):
    kernels: Kernels = TORCH

    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        tp = current_tp_group()
        full = config.intermediate_size
        inner = Shard(0, *split_evenly(full, tp.world_size, tp.rank), full)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inner, inner], bias=bias)
        self.down_proj = RowParallelLinear(inner, config.hidden_size, bias=bias)
        self.act = config.hidden_act

    def forward(self, x):
        return self.down_proj(self.activate(x))

    def forward_add_norm(self, x, residual, norm: nn.Module):
        """norm(mlp(x) + residual), with down_proj's product handed to the norm where the
        kernel set fuses them (see linear_add_norm)."""
        return linear_add_norm(self.down_proj, self.activate(x), residual, norm)

    def activate(self, x):
        """act(gate) * up: the input of down_proj."""
        gate_up, fused = self.gate_up_proj, self.kernels.linear_silu_and_mul
        if fused is not None and self.act == "silu" and gate_up.bias is None and gate_up.lora is None:
            return fused(x, gate_up.weight)
        return act_and_mul(gate_up(x), self.act, self.kernels)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, attention: LlamaAttention, mlp: LlamaMLP | SparseMoeBlock, config):
        """`mlp`: a LlamaMLP, or a sparse MoE block (model/moe.py); both end in the next norm."""
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta, next_norm: RMSNorm):
        """`hidden`: this layer's input, already through input_layernorm. Returns the
        next norm's output (the next layer's input_layernorm, or the final norm) and the
        residual stream: each projection that ends a block ends in the norm after it, so
        a decode GEMM can hand its partial sums to that norm (Kernels.linear_add_rms_norm)."""
        attn = self.self_attn.attend(positions, hidden, meta)
        hidden, residual = linear_add_norm(self.self_attn.o_proj, attn, residual, self.post_attention_layernorm)
        return self.mlp.forward_add_norm(hidden, residual, next_norm)


class LlamaModel(nn.Module):
    def __init__(self, config, make_layer, norm: type[nn.Module] = RMSNorm):
        """`make_layer(i)`: decoder layer i, which takes its input through its own
        input_layernorm and ends in the next norm (as LlamaDecoderLayer); `norm`: the
        residual stream's norms (a hybrid model's are zero-centred)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        residual = self.embed_tokens(input_ids)
        layers = self.layers
        hidden = layers[0].input_layernorm(residual)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            hidden, residual = layer(positions, hidden, residual, meta, next_norm)
        return hidden


class LlamaForCausalLM(CausalLM):
    qkv_bias: bool | None = None  # None: from config.attention_bias
    o_bias: bool | None = None
    qk_norm = False

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, lambda i: LlamaDecoderLayer(self.attention(config), self.mlp(config, i),
                                                                  config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.packed_modules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                               "gate_up_proj": ["gate_proj", "up_proj"]}

    def attention(self, config) -> LlamaAttention:
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = attention_bias if self.o_bias is None else self.o_bias
        return LlamaAttention(config, qkv_bias, o_bias, self.qk_norm)

    def mlp(self, config, layer: int) -> LlamaMLP | SparseMoeBlock:
        """Decoder layer `layer`'s MLP (the MoE architectures make some of them sparse)."""
        return LlamaMLP(config)

    def forward(self, input_ids, positions, meta):
        return self.model(input_ids, positions, meta)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
