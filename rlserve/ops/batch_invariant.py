"""Batch-invariant ops: every reduction in an order fixed by the problem, never by the batch.

A request's logits must not depend on what shares its step: how many rows a GEMM has, where
its row sits among them, how its prompt was chunked, whether its prefix came from the cache.
torch's own GEMM picks its blocking (and so each dot product's summation order) from M, and
a fused attention kernel picks its KV split from the query length. Here:

- linear: the rows go through the GEMM in tiles of ROW_TILE (the last one zero-padded), so
  the library always sees the same [ROW_TILE, K] x [K, N] problem and a row's result does
  not depend on the others or on its place among them (nor on N: a fused qkv projection
  gives the bits of three separate ones).
- attention: per sequence, queries in tiles of Q_TILE, keys in blocks of KV_BLOCK at fixed
  absolute positions, an online softmax over the blocks in order. A block a query cannot see
  leaves its state exactly as it was (scale 1.0, adds 0.0), so how many blocks a chunk walks
  does not change the bits of a query. On CUDA the paged Triton kernel walks the keys so
  (ops/triton_attention.py, batch_invariant=True: one tile shape, no KV split), for the
  server's paged cache and for a trainer's dense keys alike.
- rms_norm: transformers' arithmetic around `row_mean`, a mean per row in an order fixed by
  the row length (torch's on CPU; on CUDA, where torch's reduction picks its split from the
  number of rows, the Triton kernel of ops/triton_batch_invariant.py). On CUDA the server
  runs it as one launch with the same bits where that holds (ops/invariant_fusions.py).
- log_softmax: torch's, one row at a time.
- fused_moe: the router's GEMM is `linear`; the experts' GEMMs go through `linear` (CPU) or
  the Triton MoE kernel with one block shape (CUDA, triton_moe.INVARIANT_CONFIG); each
  token's expert outputs are added in a fixed order.
- lora: the shrink and expand GEMMs through `linear` (CPU); on CUDA the Triton LoRA kernels,
  whose tiles and K split follow the adapter's shapes alone (ops/triton_lora.py).

On CUDA, linear, row_mean and attention run ops/triton_batch_invariant.py's kernels. The serving side calls the
functions; rlserve.batch_invariant registers the same functions as torch.library ops with
autograd for a trainer's forward, so both compute the same bits per row.
"""

from __future__ import annotations

import torch

ROW_TILE = 16
Q_TILE = 16
KV_BLOCK = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias), one fixed-shape GEMM per ROW_TILE rows (on CUDA
    the Triton GEMM, whose tiles follow N and K)."""
    if x.is_cuda:
        from rlserve.ops import triton_batch_invariant
        return triton_batch_invariant.linear(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    m, n = rows.shape[0], weight.shape[0]
    w_t = weight.contiguous().t()
    full = m - m % ROW_TILE
    out = rows.new_empty((m, n))
    for start in range(0, full, ROW_TILE):
        torch.mm(rows[start:start + ROW_TILE], w_t, out=out[start:start + ROW_TILE])
    if full < m:
        tail = rows.new_zeros((ROW_TILE, k))
        tail[:m - full] = rows[full:]
        out[full:] = torch.mm(tail, w_t)[:m - full]
    if bias is not None:
        out += bias
    return out.reshape(*lead, n)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> [..., 1]: each row's mean (float32 rows: float32)."""
    if x.is_cuda:
        from rlserve.ops import triton_batch_invariant
        return triton_batch_invariant.row_mean(x).to(x.dtype)
    return x.mean(-1, keepdim=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fused_ref.rms_norm (transformers' rounding) with the mean taken by `row_mean`: the
    arithmetic a trainer's RMSNorm runs under rlserve.batch_invariant."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(row_mean(h.pow(2)) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Over the last dimension, in float32."""
    return torch.log_softmax(x.float(), dim=-1)


def _blocks(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[L, Hkv, D] -> [ceil(L / KV_BLOCK), heads, KV_BLOCK, D], zero-padded, the kv heads
    repeated for grouped queries; each block contiguous, so every GEMM sees the same strides."""
    length, kv_heads, dim = x.shape
    padded = -(-length // KV_BLOCK) * KV_BLOCK
    if padded != length:
        x = torch.cat([x, x.new_zeros((padded - length, kv_heads, dim))])
    if heads != kv_heads:
        x = x.repeat_interleave(heads // kv_heads, dim=1)
    return x.view(padded // KV_BLOCK, KV_BLOCK, heads, dim).permute(0, 2, 1, 3).contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
              visible: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence: queries q [M, H, D] at positions q_start .. q_start + M - 1 attend
    causally to keys/values k, v [L, Hkv, D] at positions 0 .. L - 1. `visible`: [M, L]
    bool, which keys each query sees instead of the causal rule (a trainer's padding mask).
    Returns [M, H, D] in q's dtype."""
    if not q.is_cuda:
        return _attention_blocks(q, k, v, q_start, scale, visible)
    from rlserve.ops import triton_batch_invariant
    m = q.shape[0]
    out = triton_batch_invariant.attention(q, k, v, q_start, scale)
    if visible is not None:
        # Rows the mask treats as the causal rule does (every row of a right-padded
        # sequence's real tokens) keep the kernel's bits; the others (padding) take the
        # torch walk over their own mask.
        keys = torch.arange(visible.shape[1], device=q.device)
        causal = keys[None, :] <= (torch.arange(m, device=q.device) + q_start)[:, None]
        other = (visible != causal).any(-1).nonzero().flatten()
        if other.numel():
            out[other] = _attention_blocks(q[other], k, v, q_start, scale, visible[other])
    return out


def _attention_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
                      visible: torch.Tensor | None) -> torch.Tensor:
    """`attention` in torch ops: the CPU's (and on CUDA, rows with a mask of their own)."""
    m, heads, dim = q.shape
    length = k.shape[0]
    kb, vb = _blocks(k, heads), _blocks(v, heads)
    m_pad = -(-m // Q_TILE) * Q_TILE
    tiles = m_pad // Q_TILE
    qh = q.new_zeros((m_pad, heads, dim))
    qh[:m] = q
    qh = qh.view(tiles, Q_TILE, heads, dim).permute(0, 2, 1, 3).contiguous()  # [tiles, H, Qt, D]
    # Padded query rows sit at the last position: they see keys, so nothing turns NaN.
    qpos = (torch.arange(m_pad, device=q.device).clamp(max=m - 1) + q_start).view(tiles, 1, Q_TILE, 1)
    if visible is not None:
        vis = visible.new_zeros((m_pad, kb.shape[0] * KV_BLOCK))
        vis[:m, :length] = visible
        vis = vis.view(tiles, 1, Q_TILE, -1)
        num_blocks = kb.shape[0]
    else:
        num_blocks = -(-min(m - 1 + q_start + 1, length) // KV_BLOCK)
    neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
    run_max = torch.full((tiles, heads, Q_TILE), float("-inf"), dtype=q.dtype, device=q.device)
    denom = torch.zeros((tiles, heads, Q_TILE), dtype=q.dtype, device=q.device)
    acc = torch.zeros((tiles, heads, Q_TILE, dim), dtype=q.dtype, device=q.device)
    key_pos = torch.arange(KV_BLOCK, device=q.device)
    # Every tile walks every block; a block a row cannot see leaves its state bit for bit.
    for b in range(num_blocks):
        kpos = key_pos + b * KV_BLOCK
        if visible is not None:
            seen = vis[..., b * KV_BLOCK:(b + 1) * KV_BLOCK]
        else:
            seen = (kpos <= qpos) & (kpos < length)
        s = torch.matmul(qh, kb[b].transpose(1, 2)) * scale  # [tiles, H, Qt, KV_BLOCK]
        s = torch.where(seen, s, neg_inf)
        new_max = torch.maximum(run_max, s.amax(-1))
        # A row that has seen no key yet keeps -inf; subtract 0 there, not -inf.
        shift = torch.where(new_max == neg_inf, 0.0, new_max)
        alpha = torch.exp(run_max - shift)
        p = torch.exp(s - shift[..., None])
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, vb[b])
        run_max = new_max
    out = acc / torch.where(denom == 0, 1.0, denom)[..., None]
    return out.permute(0, 2, 1, 3).reshape(m_pad, heads, dim)[:m]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                    scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """The kernel set's paged attention (ops/attention.py's layout): `attention` per sequence
    over the keys gathered from its blocks; on CUDA the Triton kernel over the whole batch
    (nothing read on the host: it replays in a CUDA graph)."""
    if query.is_cuda:
        from rlserve.ops import triton_attention
        return triton_attention.paged_attention(
            query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, seq_order=meta.seq_order,
            k_scale=k_scale, v_scale=v_scale, batch_invariant=True)
    from rlserve.ops.attention import dequantize
    num_kv_heads, head_dim = k_cache.shape[2:]
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start:
            continue
        blocks = meta.block_tables[b, :(seq_len + block_size - 1) // block_size].long()
        k = dequantize(k_cache[blocks], k_scale[blocks] if k_scale is not None else None)
        v = dequantize(v_cache[blocks], v_scale[blocks] if v_scale is not None else None)
        k = k.reshape(-1, num_kv_heads, head_dim)[:seq_len].to(query.dtype)
        v = v.reshape(-1, num_kv_heads, head_dim)[:seq_len].to(query.dtype)
        out[q_start:q_end] = attention(query[q_start:q_end], k, v, seq_len - (q_end - q_start), scale)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts (ops/moe.py's contract)."""
    if x.is_cuda:
        from rlserve.ops import triton_moe
        return triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, config=triton_moe.INVARIANT_CONFIG)
    from rlserve.ops import moe
    return moe.fused_moe(x, w13, w2, topk_weights, topk_ids, linear=linear)


def lora(y, x, a, b, slices, slice_table, batch) -> None:
    """y += each token's adapter delta (the kernel set's `lora`, ops/lora.py's layout)."""
    if x.is_cuda:
        from rlserve.ops import triton_lora
        triton_lora.lora_shrink_expand(y, x, a, b, slices, slice_table, batch.sorted_tokens, batch.slot_starts)
        return
    from rlserve.ops.lora import lora_reference
    lora_reference(y, x, a, b, slices, batch, linear=linear)
