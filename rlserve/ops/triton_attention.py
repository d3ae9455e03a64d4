"""Paged attention in Triton: same contract as rlserve.ops.attention.

Importing this module imports triton; callers import it lazily, only on CUDA.

Nothing here reads GPU tensors on the host: launch grids come from shapes and from the
optional host-side hints `max_query_len` / `max_seq_len`, so the decode path can be
captured in a CUDA graph. Without the hints, safe upper bounds are used (programs with
nothing to do exit at once). The kernel is in triton_attention_kernel.py, how a call is
cut into programs in triton_attention_tiling.py, the KV store in triton_kv_store.py.
"""

from __future__ import annotations

import math

import torch
import triton

from rlserve.ops import triton_pdl
from rlserve.ops.attention import FP8_DTYPES
from rlserve.ops.triton_attention_kernel import merge_splits_kernel, paged_attn_kernel
from rlserve.ops.triton_attention_tiling import tiling
from rlserve.ops.triton_kv_store import check_last_dim, scale_args

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32, *FP8_DTYPES)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    out: torch.Tensor | None = None, num_kv_splits: int | None = None,
                    seq_order: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    batch_invariant: bool = False, _config: dict | None = None) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] against the paged cache.

    max_query_len / max_seq_len: host-side upper bounds for the batch (defaults: the number
    of tokens, and the block table's capacity). out: optional preallocated output, which may
    be a strided view. num_kv_splits: force the split-KV decode path (1 disables it).
    seq_order: optional int32 permutation of the sequences, the order their programs start
    in; longest first keeps the GPU busy to the end when lengths vary. k_scale / v_scale:
    an fp8 cache's per-row scales (see ops/attention.py). batch_invariant: one tile shape,
    no KV split (triton_attention_tiling.invariant_config): a query's bits follow its
    sequence and position alone."""
    num_tokens, num_heads, head_dim = query.shape
    _check_inputs(query, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(query)
    else:
        assert out.shape == query.shape and out.stride(-1) == 1
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if seq_order is not None:
        assert seq_order.shape[0] >= num_seqs and seq_order.dtype == torch.int32
    if max_query_len is None:
        max_query_len = num_tokens
    max_query_len = max(1, min(int(max_query_len), num_tokens))
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * k_cache.shape[1]
    t = tiling(query, k_cache, num_seqs, max_query_len, int(max_seq_len), num_kv_splits, _config, batch_invariant)
    if t.splits > 1:
        part_out = torch.empty((num_tokens, num_heads, t.splits, t.block_d),
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_tokens, num_heads, t.splits),
                               dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    ks, vs, stride_sb, stride_ss = scale_args(k_cache, k_scale, v_scale, query)
    paged_attn_kernel[t.grid](
        query, k_cache, v_cache, out, part_out, part_lse,
        query_start_loc, seq_lens, block_tables, seq_order if seq_order is not None else seq_lens,
        ks, vs, scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), stride_sb, stride_ss,
        block_tables.stride(0), num_heads,
        stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_vh=v_cache.stride(2),
        ORDERED=seq_order is not None, PDL=triton_pdl.enabled(query.device), **t.constants,
    )
    if t.splits > 1:
        merge_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads,
            NUM_SPLITS=t.splits, SPLITS_PAD=triton.next_power_of_2(t.splits),
            HEAD_DIM=head_dim, BLOCK_D=t.block_d, num_warps=4,
        )
    return out


def _check_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads, kv_dim = k_cache.shape[1:]
    assert kv_dim == head_dim and num_heads % num_kv_heads == 0
    assert k_cache.dtype in _SUPPORTED and v_cache.dtype == k_cache.dtype
    assert block_size & (block_size - 1) == 0, "block size must be a power of two"
    check_last_dim(query, k_cache, v_cache)

