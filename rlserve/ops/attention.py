"""Attention over a paged KV cache: the torch reference ops.

These run on any device and are the oracle the Triton kernels are tested against.

Layout (shared by every backend):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping:     [num_tokens] int64, slot = block_id * block_size + offset; -1 = skip
  query_start_loc:  [num_seqs + 1] int32, cumulative query lengths of the flat batch
  seq_lens:         [num_seqs] int32, tokens in the cache for each sequence *after* this
                    step's keys are stored (cached prefix + new tokens)
  block_tables:     [num_seqs, max_blocks] int32, block ids of each sequence, padded

The queries of sequence b sit at positions seq_lens[b] - q_len_b ... seq_lens[b] - 1, and
attention is causal: query i sees every key up to and including its own position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into their cache slots."""
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] against the cache.

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
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
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
        o = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scale)
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    return out
