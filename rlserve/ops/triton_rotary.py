"""Rotary embedding, with the optional per-head RMSNorm of Qwen3 (q_norm / k_norm) fused in.

One program per token rotates every query and key head in place, reading the token's
cos/sin row once. In the unfused torch path this is a dozen small kernels per layer.
Arithmetic is float32 with one rounding at the end (the torch path rounds after each op),
so bf16 results agree within one or two ulps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _heads(x_ptr, t, stride_t, stride_h, w_ptr, cos, sin, eps,
           NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < NUM_HEADS
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + d, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + d, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if NORM:
        var = (tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF)
        r = tl.rsqrt(var + eps)[:, None]
        # As transformers: normalise in float32, round to the activation dtype, scale.
        a = (a * r).to(x1.dtype).to(tl.float32) * tl.load(w_ptr + d).to(tl.float32)
        b = (b * r).to(x1.dtype).to(tl.float32) * tl.load(w_ptr + HALF + d).to(tl.float32)
        a = a.to(x1.dtype).to(tl.float32)
        b = b.to(x1.dtype).to(tl.float32)
    tl.store(base + d, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(base + HALF + d, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, eps,
                 NQ: tl.constexpr, NK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 HALF: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + pos * stride_cos + d)  # the table's two halves are equal
    sin = tl.load(sin_ptr + pos * stride_cos + d)
    _heads(q_ptr, t, stride_qt, stride_qh, qw_ptr, cos, sin, eps, NQ, BLOCK_Q, HALF, NORM)
    _heads(k_ptr, t, stride_kt, stride_kh, kw_ptr, cos, sin, eps, NK, BLOCK_K, HALF, NORM)


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, q_weight: torch.Tensor | None = None,
          k_weight: torch.Tensor | None = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [T, Hq, D] and k [T, Hkv, D] (strided views are fine); cos/sin are the
    float32 [max_position, D] tables. With weights, RMSNorm each head first."""
    num_tokens, nq, dim = q.shape
    nk = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and dim % 2 == 0
    assert dim & (dim - 1) == 0, "head_dim must be a power of two"
    norm = q_weight is not None
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            q, k, positions, cos, sin, q_weight if norm else q, k_weight if norm else k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), eps,
            NQ=nq, NK=nk, BLOCK_Q=triton.next_power_of_2(nq), BLOCK_K=triton.next_power_of_2(nk),
            HALF=dim // 2, NORM=norm, num_warps=4)
    return q, k
