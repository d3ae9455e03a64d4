"""Picks the implementation of each op by the tensor's device: Triton on CUDA, the torch
reference elsewhere (and on CUDA when RLSERVE_ATTENTION_BACKEND=torch)."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from rlserve.ops import attention as ref


@functools.cache
def _triton_enabled() -> bool:
    if os.environ.get("RLSERVE_ATTENTION_BACKEND", "").lower() == "torch":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and _triton_enabled()


def uses_triton(device: torch.device) -> bool:
    return device.type == "cuda" and _triton_enabled()


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    if _use_triton(key):
        from rlserve.ops import triton_attention
        triton_attention.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    else:
        ref.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    if _use_triton(query):
        from rlserve.ops import triton_attention
        return triton_attention.paged_attention(
            query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            scale, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            seq_order=meta.seq_order)
    return ref.paged_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                               meta.block_tables, scale)


def fused_rope_available(q: torch.Tensor) -> bool:
    head_dim = q.shape[-1]
    return _use_triton(q) and head_dim & (head_dim - 1) == 0 and q.stride(-1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x) and x.is_contiguous():
        from rlserve.ops import triton_fused
        return triton_fused.rms_norm(x, weight, eps)
    # Same arithmetic as transformers' LlamaRMSNorm: float32 statistics, cast back, scale.
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    if _use_triton(x):
        try:
            from rlserve.ops import triton_fused
            return triton_fused.fused_add_rms_norm(x, residual, weight, eps)
        except ImportError:
            pass
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _use_triton(x):
        try:
            from rlserve.ops import triton_fused
            return triton_fused.silu_and_mul(x)
        except ImportError:
            pass
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
