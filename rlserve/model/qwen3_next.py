"""Hybrid decoders: Qwen3-Next, Qwen3.5 (dense and MoE), as transformers 5 computes them.

Three of every four layers (config.layer_types) are Gated DeltaNet linear attention
(gated_deltanet.py), the others gated full attention over the paged KV cache: the query
projection also yields a per-channel output gate, q and k are RMS-normalised per head,
and only the first `partial_rotary_factor` of each head is rotated. Every norm of the
residual stream is zero-centred (scales by 1 + weight). The MLP is dense (Qwen3.5), or
a sparse MoE block with a shared expert (Qwen3-Next, Qwen3.5-MoE) on the stacked-expert
path of moe.py.

Names: the text models (`...ForCausalLM`) hold `model.layers.N...`; the multimodal
wrappers (`...ForConditionalGeneration`, of which only the text model is served) hold
`model.language_model.layers.N...` and a vision tower under `model.visual.`. Both
spellings load into either architecture, from a checkpoint or a live update (a trainer
holding one model may serve with the other); the vision tower's and the multi-token
prediction head's names are taken and dropped (`skipped_prefixes`).
"""

from __future__ import annotations

import torch
from torch import nn

from rlserve.distributed import current_tp_group, partition_heads
from rlserve.model.base import CausalLM, WeightSlot
from rlserve.model.gated_deltanet import GatedDeltaNet, LinearAttentionShape, StateBatch
from rlserve.model.layers import AttentionMetadata, PagedAttention, RotaryEmbedding
from rlserve.model.llama import LlamaMLP, LlamaModel, _rope
from rlserve.model.moe import MoEConfig, SparseMoeBlock
from rlserve.model.parallel import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, Shard
from rlserve.ops import fused_ref

TEXT = "model."
MULTIMODAL = "model.language_model."


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), in float32 (transformers' Gemma-style norm);
    with `residual`, returns (norm(x + residual), x + residual) as RMSNorm does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (f * (1.0 + self.weight.float())).to(x.dtype)


def _rotary_dim(config, head_dim: int) -> int:
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj gives each head's query and its gate
    (this rank's heads, split as for every attention layer: partition_heads)."""

    def __init__(self, config):
        super().__init__()
        tp = current_tp_group()
        total, total_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = getattr(config, "head_dim", None) or config.hidden_size // total
        heads = partition_heads(total, total_kv, tp.world_size, tp.rank)
        self.num_heads, self.num_kv_heads = heads.num_q, heads.num_kv
        q_size, kv_size = 2 * self.num_heads * d, self.num_kv_heads * d
        bias = bool(getattr(config, "attention_bias", False))
        # q_proj holds each head's query then its gate: a run of heads is a run of rows.
        q = Shard(0, heads.q_start * 2 * d, q_size, total * 2 * d)
        kv = Shard(0, heads.kv_start * d, kv_size, total_kv * d)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q, kv, kv], bias=bias)
        self.o_proj = RowParallelLinear(Shard(0, heads.q_start * d, q_size // 2, total * d), config.hidden_size,
                                        bias=bias)
        self.sizes = [q_size, kv_size, kv_size]
        self.q_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        theta, scaling = _rope(config)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope_parameters.rope_type: hybrid models support default, got {rope_type!r}")
        self.rotary_dim = _rotary_dim(config, d)
        # Only the table; the rotation is done here, on the first rotary_dim channels.
        self.rotary_emb = RotaryEmbedding(self.rotary_dim, config.max_position_embeddings, theta)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d ** -0.5)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((fused_ref.rotate(rot, cos, sin), rest), dim=-1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n, d = hidden.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(hidden).split(self.sizes, dim=-1)
        q, gate = q_gate.view(n, self.num_heads, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, d))
        cos = self.rotary_emb.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.rotary_emb.sin[positions].unsqueeze(1).to(q.dtype)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        out = self.attn(q.contiguous(), k.contiguous(), v.reshape(n, self.num_kv_heads, d).contiguous(), meta)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config, layer: int, mixer: GatedDeltaNet | GatedAttention, mlp: LlamaMLP | SparseMoeBlock):
        super().__init__()
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta: AttentionMetadata, next_norm: ZeroCentredRMSNorm):
        """As LlamaDecoderLayer's (LlamaModel runs both): `hidden` is already through
        input_layernorm; returns the next norm's output and the residual stream."""
        if hasattr(self, "linear_attn"):
            states = meta.states
            assert isinstance(states, StateBatch), "a hybrid model's step carries its state slots"
            hidden = self.linear_attn(hidden, states)
        else:
            hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp.forward_add_norm(hidden, residual, next_norm)


def layer_types(config) -> list[str]:
    """transformers' layer_types, or its rule from full_attention_interval."""
    types = getattr(config, "layer_types", None)
    if types is None:
        interval = int(getattr(config, "full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(config.num_hidden_layers)]
    types = list(types)
    if len(types) != config.num_hidden_layers or not set(types) <= {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types: {config.num_hidden_layers} entries of linear_attention or "
                         f"full_attention expected, got {types}")
    if "full_attention" not in types:
        raise ValueError("layer_types: at least one full_attention layer is needed (the KV cache holds them)")
    return types


class HybridForCausalLM(CausalLM):
    """The hybrid decoders' common body; subclasses say how projections and MLPs look."""

    fused_input = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba
    spelling = TEXT  # the names this architecture's own checkpoints use
    # Taken and dropped: the vision tower (a trainer pushes its whole model), and the
    # multi-token prediction head, which rlserve does not run.
    skipped_prefixes: tuple[str, ...] = ("model.visual.", "visual.", "mtp.")
    hybrid = True

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.linear_shape = LinearAttentionShape.read(config)
        types = layer_types(config)
        self.model = LlamaModel(config, lambda i: HybridDecoderLayer(
            config, i, GatedDeltaNet(config, self.fused_input) if types[i] == "linear_attention"
            else GatedAttention(config), self.mlp(config, i)), ZeroCentredRMSNorm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.packed_modules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                               "gate_up_proj": ["gate_proj", "up_proj"]}

    def moe_config(self) -> MoEConfig | None:
        return None

    def mlp(self, config, layer: int) -> LlamaMLP | SparseMoeBlock:
        moe = self.moe_config()
        if moe is not None and moe.is_sparse(layer):
            return SparseMoeBlock(config, moe)
        return LlamaMLP(config)

    def forward(self, input_ids, positions, meta):
        return self.model(input_ids, positions, meta)

    def _fused_lookup(self) -> dict[str, WeightSlot]:
        """Every name under both spellings: this architecture's own required, the other's
        optional, standing for it (a name sent under both is sent twice)."""
        if getattr(self, "_slots", None) is None:
            ours = super()._fused_lookup()  # the module tree's names: `model.layers...`
            other = MULTIMODAL if self.spelling == TEXT else TEXT

            def own(name: str) -> str:
                return self.spelling + name[len(TEXT):] if name.startswith(TEXT) else name

            def alias(name: str) -> str:
                return other + name[len(TEXT):] if name.startswith(TEXT) else name

            lookup: dict[str, WeightSlot] = {}
            for name, slot in ours.items():
                covers = tuple(map(own, slot.covers))
                lookup[own(name)] = slot._replace(covers=covers)
                if alias(name) != own(name):
                    lookup[alias(name)] = slot._replace(
                        covers=(own(name), *covers, *map(alias, slot.covers)))
            self._slots = lookup
        return self._slots

    def activation_width(self) -> int:
        s, hf = self.linear_shape, self.config
        width = max(super().activation_width(), 2 * (s.conv_dim + s.value_dim + 2 * s.num_v_heads),
                    4 * hf.num_attention_heads * (getattr(hf, "head_dim", None) or 0))
        moe = self.moe_config()
        if moe is not None:
            width = max(width, moe.top_k * (3 * moe.intermediate_size + 2 * hf.hidden_size))
        return width


class Qwen3_5ForCausalLM(HybridForCausalLM):
    pass


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text model of Qwen3.5's multimodal checkpoint (registry.served_config unwraps
    its text_config)."""

    spelling = MULTIMODAL


class Qwen3NextForCausalLM(HybridForCausalLM):
    fused_input = True

    def moe_config(self) -> MoEConfig | None:
        if not int(getattr(self.config, "num_experts", 0) or 0):
            return None
        return MoEConfig.read(self.config)


class Qwen3_5MoeForCausalLM(HybridForCausalLM):
    def moe_config(self) -> MoEConfig | None:
        c = self.config
        # Every layer sparse; the router always renormalises its top-k (transformers'
        # Qwen3.5-MoE router has no norm_topk_prob).
        return MoEConfig(int(c.num_experts), int(c.num_experts_per_tok), int(c.moe_intermediate_size), True,
                         shared_intermediate_size=int(getattr(c, "shared_expert_intermediate_size", 0) or 0))


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    spelling = MULTIMODAL
