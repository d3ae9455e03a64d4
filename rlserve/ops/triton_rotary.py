"""Rotary embedding, with the optional per-head RMSNorm of Qwen3 (q_norm / k_norm) fused in.

One program per token rotates every query and key head in place, reading the token's
cos/sin row once. In the unfused torch path this is a dozen small kernels per layer.
Arithmetic is float32 with one rounding at the end (the torch path rounds after each op),
so bf16 results agree within one or two ulps; with round_each it rounds where torch does,
for the batch-invariant mode's bits.

Optionally the same program also writes the token's rotated key and its value into the
paged KV cache (what triton_kv_store.store_kv_cache does next otherwise): decode steps
are launch-bound, and this saves one launch per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlserve.ops.triton_kv_store import fp8_limit, fp8_rows, fp8_scale, scale_args


@triton.jit
def _heads(x_ptr, t, stride_t, stride_h, w_ptr, cos, sin, eps,
           NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
           ROUND_EACH: tl.constexpr):
    """Rotates one token's heads in place; returns the two rotated halves as stored.
    ROUND_EACH: torch's rounding (cos and sin in the activation dtype, each product and the
    sum rounded to it), for the batch-invariant mode's bits."""
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
    if ROUND_EACH:
        c = cos.to(x1.dtype).to(tl.float32)
        s = sin.to(x1.dtype).to(tl.float32)
        lo = ((a * c).to(x1.dtype).to(tl.float32) - (b * s).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        hi = ((b * c).to(x1.dtype).to(tl.float32) + (a * s).to(x1.dtype).to(tl.float32)).to(x1.dtype)
    else:
        lo = (a * cos - b * sin).to(x1.dtype)
        hi = (b * cos + a * sin).to(x1.dtype)
    tl.store(base + d, lo, mask=mask)
    tl.store(base + HALF + d, hi, mask=mask)
    return lo, hi


@triton.jit
def _store_kv(k_lo, k_hi, v_ptr, t, stride_vt, stride_vh, k_cache_ptr, v_cache_ptr, slot_ptr,
              stride_cb, stride_cs, stride_ch, ks_ptr, vs_ptr, stride_sb, stride_ss,
              NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, LIMIT: tl.constexpr):
    """Writes the token's rotated key halves and its value to cache slot slot_ptr[t]
    (fp8 caches, LIMIT > 0: quantized, with each head row's scale)."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: padding, nothing to store
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, HALF)[None, :]
        mask = h < NUM_HEADS
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
        src = v_ptr + t * stride_vt + h * stride_vh + d
        v_lo = tl.load(src, mask=mask, other=0.0)
        v_hi = tl.load(src + HALF, mask=mask, other=0.0)
        cache_ty = k_cache_ptr.dtype.element_ty
        if LIMIT > 0:
            ks = fp8_scale(tl.maximum(tl.max(tl.abs(k_lo.to(tl.float32)), 1),
                                      tl.max(tl.abs(k_hi.to(tl.float32)), 1)), LIMIT)
            vs = fp8_scale(tl.maximum(tl.max(tl.abs(v_lo.to(tl.float32)), 1),
                                      tl.max(tl.abs(v_hi.to(tl.float32)), 1)), LIMIT)
            hs = tl.arange(0, BLOCK_H)
            tl.store(ks_ptr + blk * stride_sb + off * stride_ss + hs, ks, mask=hs < NUM_HEADS)
            tl.store(vs_ptr + blk * stride_sb + off * stride_ss + hs, vs, mask=hs < NUM_HEADS)
            out_k_lo, out_k_hi = fp8_rows(k_lo, ks, cache_ty, LIMIT), fp8_rows(k_hi, ks, cache_ty, LIMIT)
            out_v_lo, out_v_hi = fp8_rows(v_lo, vs, cache_ty, LIMIT), fp8_rows(v_hi, vs, cache_ty, LIMIT)
        else:
            out_k_lo, out_k_hi = k_lo.to(cache_ty), k_hi.to(cache_ty)
            out_v_lo, out_v_hi = v_lo.to(cache_ty), v_hi.to(cache_ty)
        tl.store(k_cache_ptr + dst, out_k_lo, mask=mask)
        tl.store(k_cache_ptr + dst + HALF, out_k_hi, mask=mask)
        tl.store(v_cache_ptr + dst, out_v_lo, mask=mask)
        tl.store(v_cache_ptr + dst + HALF, out_v_hi, mask=mask)


# Every integer argument is fixed by the model and the cache layout (the token count is
# only the grid), so specialising on them compiles one variant per run.
@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, eps,
                 v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                 stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                 ks_ptr, vs_ptr, stride_sb, stride_ss,
                 NQ: tl.constexpr, NK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 HALF: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, LIMIT: tl.constexpr, ROUND_EACH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + pos * stride_cos + d)  # the table's two halves are equal
    sin = tl.load(sin_ptr + pos * stride_cos + d)
    _heads(q_ptr, t, stride_qt, stride_qh, qw_ptr, cos, sin, eps, NQ, BLOCK_Q, HALF, NORM, ROUND_EACH)
    k_lo, k_hi = _heads(k_ptr, t, stride_kt, stride_kh, kw_ptr, cos, sin, eps, NK, BLOCK_K, HALF, NORM,
                        ROUND_EACH)
    if STORE:
        _store_kv(k_lo, k_hi, v_ptr, t, stride_vt, stride_vh, k_cache_ptr, v_cache_ptr, slot_ptr,
                  stride_cb, stride_cs, stride_ch, ks_ptr, vs_ptr, stride_sb, stride_ss,
                  NK, BLOCK_K, HALF, BLOCK_SIZE, LIMIT)


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, q_weight: torch.Tensor | None = None,
          k_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
          v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
          v_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
          round_each: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [T, Hq, D] and k [T, Hkv, D] (strided views are fine); cos/sin are the
    float32 [max_position, D] tables. With weights, RMSNorm each head first.

    With v [T, Hkv, D], the paged caches [num_blocks, block_size, Hkv, D] and slot_mapping,
    also store each token's rotated key and its value at slot_mapping[t] (-1: skip), cast
    to the cache dtype (fp8 caches: quantized, scales in k_scale / v_scale): the same
    result as triton_kv_store.store_kv_cache afterwards.

    round_each: the torch path's rounding after every op (fused_ref.rotate), bit for bit; no
    per-head norm (the batch-invariant mode normalises with its own kernel first).
    """
    num_tokens, nq, dim = q.shape
    nk = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and dim % 2 == 0
    assert dim & (dim - 1) == 0, "head_dim must be a power of two"
    norm = q_weight is not None
    assert not (norm and round_each), "round_each: normalise the heads first"
    store = k_cache is not None
    if k_cache is not None:
        assert v is not None and v_cache is not None and slot_mapping is not None
        assert v.shape == k.shape and v.stride(-1) == 1
        assert k_cache.shape[2:] == (nk, dim), "cache/key shape mismatch"
        # One set of strides serves both: they are views of one pool.
        assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
        assert k_cache.stride(-1) == 1 and v_cache.dtype == k_cache.dtype
        assert slot_mapping.shape[0] >= num_tokens
        cache_args = (v, k_cache, v_cache, slot_mapping, v.stride(0), v.stride(1),
                      *k_cache.stride()[:3], *scale_args(k_cache, k_scale, v_scale, k))
        block_size, limit = k_cache.shape[1], fp8_limit(k_cache)
    else:
        assert v is None and v_cache is None and slot_mapping is None
        # Never read: any pointers, zero strides.
        cache_args = (k, k, k, positions, 0, 0, 0, 0, 0, k, k, 0, 0)
        block_size, limit = 1, 0.0
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            q, k, positions, cos, sin, q_weight if norm else q, k_weight if norm else k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), eps, *cache_args,
            NQ=nq, NK=nk, BLOCK_Q=triton.next_power_of_2(nq), BLOCK_K=triton.next_power_of_2(nk),
            HALF=dim // 2, NORM=norm, STORE=store, BLOCK_SIZE=block_size, LIMIT=limit, ROUND_EACH=round_each,
            num_warps=4, enable_fp_fusion=not round_each)
    return q, k
