"""Building blocks shared by the architectures: norms, rotary embedding, paged attention."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlserve.ops import fused_ref
from rlserve.ops.kernels import TORCH, Kernels

if TYPE_CHECKING:
    from rlserve.model.gated_deltanet import StateBatch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache (see rlserve/ops/attention.py)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # [num_seqs] int32, the sequences longest first: the order attention starts them in
    seq_order: torch.Tensor | None = None
    # A hybrid model's step: each sequence's state slot (model/gated_deltanet.py)
    states: StateBatch | None = None


class RMSNorm(nn.Module):
    kernels: Kernels = TORCH  # the worker binds its set (rlserve.ops.kernels.bind)

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`: returns (norm(x + residual), x + residual), fused on GPU."""
        if residual is not None:
            return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return self.kernels.rms_norm(x, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1 long-context scaling: low frequencies divided by `factor`, high ones kept,
    # a smooth ramp between.
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table (float32)."""

    kernels: Kernels = TORCH
    cos: torch.Tensor  # buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type not in ("default", None):
            raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r} "
                             "(supported: default, llama3)")
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Not parameters: never touched by weight loading, rebuilt on the model's device.
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        """q: [T, Hq, D], k: [T, Hkv, D]; with q_norm/k_norm (Qwen3), each head is
        RMS-normalised first. With the fused kernel one launch does both, in place."""
        rope = self.kernels.rope
        if rope is not None and self.kernels.fuses_rope(q):
            if q_norm is None:
                return rope(q, k, positions, self.cos, self.sin)
            assert k_norm is not None  # the per-head norms come as a pair
            return rope(q, k, positions, self.cos, self.sin, q_norm.weight, k_norm.weight, q_norm.eps)
        if q_norm is not None:
            assert k_norm is not None
            q, k = q_norm(q), k_norm(k)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return fused_ref.rotate(q, cos, sin), fused_ref.rotate(k, cos, sin)

    def forward_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, attn: PagedAttention, slot_mapping: torch.Tensor,
                          q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> None:
        """As forward, in place, and also writes the rotated k and v [T, Hkv, D] into `attn`'s
        paged cache at slot_mapping: one kernel. Only where fuse_rope_and_store(q, attn)."""
        rope = self.kernels.rope
        assert rope is not None  # fuse_rope_and_store(q, attn) holds
        qw = kw = None
        eps = 1e-6
        if q_norm is not None:
            assert k_norm is not None  # the per-head norms come as a pair
            qw, kw, eps = q_norm.weight, k_norm.weight, q_norm.eps
        rope(q, k, positions, self.cos, self.sin, qw, kw, eps,
             v=v, k_cache=attn.k_cache, v_cache=attn.v_cache, slot_mapping=slot_mapping,
             k_scale=attn.k_scale, v_scale=attn.v_scale)


class PagedAttention(nn.Module):
    """Stores this step's keys/values in the paged cache, then attends over it.

    The model runner binds `k_cache`/`v_cache` (views into one pool) before the first step,
    and for fp8 caches their per-row scales `k_scale`/`v_scale` (ops/attention.py).
    """

    kernels: Kernels = TORCH

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, stored: bool = False) -> torch.Tensor:
        """`stored`: this step's k/v are already in the cache (see fuse_rope_and_store)."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # fp8 caches only: the kernel sets' plain signature stays for every other cache.
        scales = {} if self.k_scale is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if not stored:
            self.kernels.store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, **scales)
        out = self.kernels.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, **scales)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


def fuse_rope_and_store(q: torch.Tensor, attn: PagedAttention) -> bool:
    """Whether RotaryEmbedding.forward_and_store can fill `attn`'s cache in the rotary kernel
    (the fused kernel, with the cache bound). Decode steps are launch-bound, so that saves
    the store kernel in every layer; elsewhere rotary and store stay separate ops."""
    return attn.k_cache is not None and attn.kernels.fuses_rope(q)


def linear_add_norm(linear, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """norm(linear(x), residual): (the normed sum, the sum). `linear` a RowParallelLinear;
    the kernel set's fused op takes it where nothing else touches the product between
    (no bias, no adapter, no all-reduce) and `norm` is an RMSNorm (a kernel set's)."""
    fused = norm.kernels.linear_add_rms_norm if isinstance(norm, RMSNorm) else None
    if fused is not None and linear.bias is None and linear.lora is None and linear.tp.world_size == 1:
        return fused(x, linear.weight, residual, norm.weight, norm.eps)
    return norm(linear(x), residual)


def act_and_mul(x: torch.Tensor, act: str, kernels: Kernels = TORCH) -> torch.Tensor:
    if act == "silu":
        return kernels.silu_and_mul(x)
    half = x.shape[-1] // 2
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return nn.functional.gelu(x[..., :half], approximate="tanh") * x[..., half:]
    if act == "gelu":
        return nn.functional.gelu(x[..., :half]) * x[..., half:]
    raise ValueError(f"hidden_act: unsupported {act!r} (supported: silu, gelu, gelu_pytorch_tanh)")
