"""Attention over a paged KV cache: the torch reference ops.

These run on any device and are the oracle the Triton kernels are tested against.

Layout (shared by every backend):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping:     [num_tokens] int64, slot = block_id * block_size + offset; -1 = skip
  query_start_loc:  [num_seqs + 1] int32, cumulative query lengths of the flat batch
  seq_lens:         [num_seqs] int32, tokens in the cache for each sequence *after* this
                    step's keys are stored (cached prefix + new tokens)
  block_tables:     [num_seqs, max_blocks] int32, block ids of each sequence, padded

fp8 caches (float8_e4m3fn, float8_e5m2) carry one float32 scale per token and kv head:
  k_scale, v_scale: [num_blocks, block_size, num_kv_heads]; the stored row is
                    x / scale rounded to fp8, scale = max|x| / the format's largest value
so each head vector uses the format's whole range (no calibration, nothing to redo when
the weights change). Attention widens x = row * scale; the reference computes in the
query's dtype (the Triton kernel in float16 for half-precision queries, see there).

The queries of sequence b sit at positions seq_lens[b] - q_len_b ... seq_lens[b] - 1, and
attention is causal: query i sees every key up to and including its own position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Smallest scale: an all-zero row stores zeros instead of 0 / 0.
MIN_SCALE = 1e-20


def fp8_max(dtype: torch.dtype) -> float | None:
    """Largest finite value of an fp8 cache type; None for other types."""
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else None


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (rows in fp8 `dtype`, float32 scales [...]); see the module doc."""
    limit = fp8_max(dtype)
    assert limit is not None, f"{dtype} is not an fp8 type"
    x = x.float()
    # Times the reciprocal, not divided: torch's CUDA division by a number multiplies by
    # its reciprocal, its CPU one divides, the kernels do either; one way keeps them equal.
    scale = (x.abs().amax(-1) * (1.0 / limit)).clamp_min(MIN_SCALE)
    return (x / scale[..., None]).clamp(-limit, limit).to(dtype), scale


def dequantize(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Rows of an fp8 cache (any leading shape) times their scales, in float32."""
    return cache.float() * scale[..., None].float() if scale is not None else cache


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into their cache slots (fp8
    caches: quantized, with their scales written to k_scale / v_scale)."""
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    rows = num_blocks * block_size
    if k_cache.dtype in FP8_DTYPES:
        assert k_scale is not None and v_scale is not None, "fp8 caches need their scales"
        key, ks = quantize_fp8(key, k_cache.dtype)
        value, vs = quantize_fp8(value, v_cache.dtype)
        k_scale.view(rows, -1).index_copy_(0, slot_mapping, ks)
        v_scale.view(rows, -1).index_copy_(0, slot_mapping, vs)
        # As bytes: CPU index_copy_ has no fp8 types.
        key, value = key.view(torch.uint8), value.view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(rows, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(rows, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] against the cache
    (k_scale / v_scale: an fp8 cache's scales).

    Returns [num_tokens, num_heads, head_dim]. One SDPA call per sequence: slow, but
    simple enough to trust.
    """
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[b, :num_blocks].long()
        k = dequantize(k_cache[blocks], k_scale[blocks] if k_scale is not None else None)
        v = dequantize(v_cache[blocks], v_scale[blocks] if v_scale is not None else None)
        k = k.reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v.reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[q_start:q_end]
        # [heads, tokens, dim]; GQA by repeating kv heads.
        q = q.transpose(0, 1)
        k = k.transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)
        if q_len == 1:
            mask = None  # a single query at the last position sees everything
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
        if k_scale is not None:  # widened fp8: computed in the query's dtype
            k, v = k.to(q.dtype), v.to(q.dtype)
        o = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scale)
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    return out
