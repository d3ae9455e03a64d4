"""OPT (facebook/opt-125m, the model of vLLM's RLHF-over-HTTP example): learned positions offset by 2, LayerNorm, ReLU,
optional project_in/project_out when word_embed_proj_dim differs from hidden_size."""

from __future__ import annotations

import torch
from torch import nn

from rlserve.distributed import current_tp_group, partition_heads, split_evenly
from rlserve.model.base import CausalLM
from rlserve.model.layers import AttentionMetadata, PagedAttention
from rlserve.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)

_POSITION_OFFSET = 2  # OPT's learned position table starts two rows in


class OPTAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        tp = current_tp_group()
        total_heads = config.num_attention_heads
        self.head_dim = h // total_heads
        heads = partition_heads(total_heads, total_heads, tp.world_size, tp.rank)
        self.num_heads = heads.num_q
        self.local_size = self.num_heads * self.head_dim
        bias = getattr(config, "enable_bias", True)
        part = Shard(0, heads.q_start * self.head_dim, self.local_size, h)
        self.qkv_proj = ColumnParallelLinear(h, [part, part, part], bias=bias)
        self.out_proj = RowParallelLinear(part, h, bias=bias)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, hidden, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(hidden).split(self.local_size, dim=-1)
        return self.out_proj(self.attn(q, k, v, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        bias = getattr(config, "enable_bias", True)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        tp = current_tp_group()
        ffn = Shard(0, *split_evenly(config.ffn_dim, tp.world_size, tp.rank), config.ffn_dim)
        self.fc1 = ColumnParallelLinear(h, [ffn], bias=bias)
        self.fc2 = RowParallelLinear(ffn, h, bias=bias)
        self.final_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        self.pre_norm = config.do_layer_norm_before
        if config.activation_function != "relu":
            raise ValueError(f"activation_function: OPT supports relu, got {config.activation_function!r}")

    def forward(self, hidden, meta):
        residual = hidden
        if self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden, meta)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(torch.relu(self.fc1(hidden)))
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        proj_dim = config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + _POSITION_OFFSET,
                                            config.hidden_size)
        differs = proj_dim != config.hidden_size
        self.project_in = nn.Linear(proj_dim, config.hidden_size, bias=False) if differs else None
        self.project_out = nn.Linear(config.hidden_size, proj_dim, bias=False) if differs else None
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        # OPT-350m (post-norm) has no final layer norm.
        final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine) if final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + _POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(hidden, meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight
        self.packed_modules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def forward(self, input_ids, positions, meta):
        return self.model.decoder(input_ids, positions, meta)
