"""The paged KV cache's store in Triton (same contract as rlserve.ops.attention.store_kv_cache),
and the fp8 row format's device helpers that the fused rotary kernel (triton_rotary.py) shares.

fp8 caches keep one float32 scale per token and kv head, from the row's largest magnitude
(ops/attention.py has the format); the bytes stored equal the torch reference's.

Importing this module imports triton; callers import it lazily, only on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlserve.ops.attention import FP8_DTYPES, fp8_max
from rlserve.ops.attention import MIN_SCALE as MIN_SCALE_F

MIN_SCALE = tl.constexpr(MIN_SCALE_F)


@triton.jit
def fp8_scale(amax, LIMIT: tl.constexpr):
    """Scale of fp8 rows whose largest magnitude is amax (ops/attention.quantize_fp8)."""
    return tl.maximum(amax * (1.0 / LIMIT), MIN_SCALE)


@triton.jit
def fp8_rows(x, scale, fp8_ty: tl.constexpr, LIMIT: tl.constexpr):
    """x [rows, cols] / scale [rows], saturated, in fp8. Division and cast round to
    nearest (even), as torch's do, so the stored bytes equal the reference's."""
    y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale[:, None]), -LIMIT, LIMIT)
    return y.to(fp8_ty, fp_downcast_rounding="rtne")


def fp8_limit(cache: torch.Tensor) -> float:
    """A cache's LIMIT for the kernels: its format's largest value; 0.0 for other types."""
    return fp8_max(cache.dtype) or 0.0


def scale_args(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
               dummy: torch.Tensor) -> tuple:
    """(k_scale, v_scale, block stride, slot stride) for a kernel; any pointers and zero
    strides for caches without scales."""
    if cache.dtype not in FP8_DTYPES:
        return dummy, dummy, 0, 0
    assert k_scale is not None and v_scale is not None, "fp8 caches need their scales"
    assert k_scale.shape == cache.shape[:3] and k_scale.dtype == torch.float32
    assert v_scale.stride() == k_scale.stride() and k_scale.stride(2) == 1
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ks_ptr, vs_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_sb, stride_ss,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, LIMIT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if LIMIT > 0:  # fp8: one scale per head row
        ks = fp8_scale(tl.max(tl.abs(k.to(tl.float32)), 1), LIMIT)
        vs = fp8_scale(tl.max(tl.abs(v.to(tl.float32)), 1), LIMIT)
        hs = tl.arange(0, BLOCK_H)
        tl.store(ks_ptr + blk * stride_sb + off * stride_ss + hs, ks, mask=hs < NUM_KV_HEADS)
        tl.store(vs_ptr + blk * stride_sb + off * stride_ss + hs, vs, mask=hs < NUM_KV_HEADS)
        k_out = fp8_rows(k, ks, k_cache_ptr.dtype.element_ty, LIMIT)
        v_out = fp8_rows(v, vs, v_cache_ptr.dtype.element_ty, LIMIT)
    else:
        k_out = k.to(k_cache_ptr.dtype.element_ty)
        v_out = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d, k_out, mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d, v_out, mask=mask)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into their cache slots (-1: skip);
    fp8 caches also get each row's scale in k_scale / v_scale (see ops/attention.py)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_last_dim(key, value, k_cache, v_cache)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "cache/key shape mismatch"
    assert slot_mapping.shape[0] >= num_tokens
    ks, vs, stride_sb, stride_ss = scale_args(k_cache, k_scale, v_scale, key)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, ks, vs,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sb, stride_ss,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        LIMIT=fp8_limit(k_cache), num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def check_last_dim(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
