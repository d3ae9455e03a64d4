"""Triton fused mixture-of-experts: the routed experts of a batch as grouped GEMMs.

Five launches a layer (and the sum), each of a shape fixed by the token count (so a decode step replays
inside a CUDA graph; nothing here reads a device value on the host):

1. `align` (three small launches, two of them over chunks of pairs in parallel) sorts the
   (token, slot) pairs by expert, stably, and cuts each expert's run of pairs into blocks of
   BLOCK_M rows: `order` (pair ids in expert order) and, per block, its expert and first and
   last row. The block table has room for the most blocks any routing can need
   (cdiv(M, BLOCK_M) + min(E, M)); the rest are marked empty and their programs return at once.
2. `_gate_up_kernel`: per block and tile of I, x[tokens] @ w13[e, gate rows].T and
   @ w13[e, up rows].T with SiLU-and-mul on the float32 accumulators, into `h` (rows in
   expert order).
3. `_down_kernel`: per block and tile of H, h @ w2[e].T, times the pair's routing weight,
   into that pair's float32 row; the k rows of a token are then summed in a fixed order
   (deterministic: no atomics).

BLOCK_M is chosen so that in a decode batch one block usually holds all of an expert's
pairs: each touched expert's weights are then read once per step, which is what decode
throughput depends on; the spare rows cost tensor-core time, which decode has to spare.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from rlserve import envs
from rlserve.ops import moe_configs


class ExpertBlocks(NamedTuple):
    """The pairs of a batch in expert order, cut into blocks (see the module docstring)."""

    order: torch.Tensor  # [M] int32: pair ids (token * k + slot) sorted by expert
    # [3, B] int32, per block: its expert, its first row in `order`, the end of that
    # expert's rows (first row == end: an empty block)
    table: torch.Tensor
    block_m: int


# Triton's interpreter multiplies bfloat16 tiles wrongly; there, tiles are widened first.
_WIDEN = envs.TRITON_INTERPRET.get()


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["M"])
def _count_kernel(ids_ptr, rank_ptr, counts_ptr, M, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Per chunk of pairs: each pair's rank among the chunk's pairs of its expert, and the
    chunk's pairs per expert."""
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < M, other=-1)
    hit = (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    rank = tl.sum(hit * (tl.cumsum(hit, axis=0) - hit), axis=1)
    tl.store(rank_ptr + p, rank, mask=p < M)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(hit, axis=0))


@triton.jit(do_not_specialize=["NUM_CHUNKS"])
def _scan_kernel(counts_ptr, runs_ptr, E, NUM_CHUNKS,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr):
    """One program: each chunk's first row per expert (written over its counts), and per
    expert its first row, its end, and the end of its run of blocks (`runs`, [3, BLOCK_E])."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, NUM_CHUNKS, ROWS):
        c = c0 + tl.arange(0, ROWS)
        tile = tl.load(counts_ptr + c[:, None] * BLOCK_E + experts[None, :], mask=(c < NUM_CHUNKS)[:, None], other=0)
        counts += tl.sum(tile, axis=0)
    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    seen = starts
    for c0 in range(0, NUM_CHUNKS, ROWS):
        c = c0 + tl.arange(0, ROWS)
        ptrs = counts_ptr + c[:, None] * BLOCK_E + experts[None, :]
        tile = tl.load(ptrs, mask=(c < NUM_CHUNKS)[:, None], other=0)
        tl.store(ptrs, seen[None, :] + tl.cumsum(tile, axis=0) - tile, mask=(c < NUM_CHUNKS)[:, None])
        seen += tl.sum(tile, axis=0)
    block_ends = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, axis=0)
    tl.store(runs_ptr + experts, starts)
    tl.store(runs_ptr + BLOCK_E + experts, ends)
    # Experts past E (padding to a power of two) own no blocks: their run never ends.
    tl.store(runs_ptr + 2 * BLOCK_E + experts, tl.where(experts < E, block_ends, 1 << 30))


@triton.jit(do_not_specialize=["M", "NUM_CHUNKS", "NUM_BLOCKS", "stride_t"])
def _scatter_kernel(ids_ptr, rank_ptr, offsets_ptr, runs_ptr, order_ptr, table_ptr,
                    M, E, NUM_CHUNKS, NUM_BLOCKS, stride_t,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """Each pair to its row (its chunk's first row for its expert plus its rank there), and
    this program's share of the block table (expert, first row, end of the expert's rows)."""
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < M, other=0)
    dest = tl.load(offsets_ptr + c * BLOCK_E + ids, mask=p < M, other=0) + tl.load(rank_ptr + p, mask=p < M, other=0)
    tl.store(order_ptr + dest, p.to(tl.int32), mask=p < M)
    experts = tl.arange(0, BLOCK_E)
    starts = tl.load(runs_ptr + experts)
    ends = tl.load(runs_ptr + BLOCK_E + experts)
    block_ends = tl.load(runs_ptr + 2 * BLOCK_E + experts)
    first_blocks = block_ends - (ends - starts + BLOCK_M - 1) // BLOCK_M
    for b0 in range(c * ROWS, NUM_BLOCKS, NUM_CHUNKS * ROWS):
        b = b0 + tl.arange(0, ROWS)
        e = tl.sum((block_ends[None, :] <= b[:, None]).to(tl.int32), axis=1)  # >= E past the last block
        mine = experts[None, :] == e[:, None]
        start = tl.sum(tl.where(mine, starts + (b[:, None] - first_blocks) * BLOCK_M, 0), axis=1)
        end = tl.sum(tl.where(mine, ends, 0), axis=1)
        valid = e < E
        tl.store(table_ptr + b, tl.where(valid, e, 0), mask=b < NUM_BLOCKS)
        tl.store(table_ptr + stride_t + b, tl.where(valid, start, 0), mask=b < NUM_BLOCKS)
        tl.store(table_ptr + 2 * stride_t + b, tl.where(valid, end, 0), mask=b < NUM_BLOCKS)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort a batch's pairs by expert (stably) and cut them into blocks of `block_m` rows:
    counts per chunk of pairs in parallel, one small program for the prefix sums, then
    every pair to its row and the block table in parallel."""
    ids = topk_ids.reshape(-1)
    m = ids.numel()
    chunk, rows, block_e = 128, 16, triton.next_power_of_2(num_experts)
    num_chunks = triton.cdiv(m, chunk)
    num_blocks = triton.cdiv(m, block_m) + min(num_experts, m)
    rank = torch.empty(m, dtype=torch.int32, device=ids.device)
    counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=ids.device)
    runs = torch.empty(3, block_e, dtype=torch.int32, device=ids.device)
    order = torch.empty(m, dtype=torch.int32, device=ids.device)
    # Rows padded to 16-byte multiples: every row starts aligned, so no launch respecializes.
    table = torch.empty(3, -(-num_blocks // 4) * 4, dtype=torch.int32, device=ids.device)[:, :num_blocks]
    _count_kernel[(num_chunks,)](ids, rank, counts, m, BLOCK_E=block_e, CHUNK=chunk, num_warps=4)
    _scan_kernel[(1,)](counts, runs, num_experts, num_chunks, BLOCK_M=block_m, BLOCK_E=block_e, ROWS=rows,
                       num_warps=4)
    _scatter_kernel[(num_chunks,)](ids, rank, counts, runs, order, table, m, num_experts, num_chunks, num_blocks,
                                   table.stride(0), BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, ROWS=rows,
                                   num_warps=4)
    return ExpertBlocks(order, table, block_m)


@triton.jit
def _block_rows(order_ptr, table_ptr, stride_t, BLOCK_M: tl.constexpr):
    """This program's block: whether it holds rows, its expert, its rows of `order` (int64),
    which of them are real, and their pairs."""
    blk = tl.program_id(0)
    start = tl.load(table_ptr + stride_t + blk)
    end = tl.load(table_ptr + 2 * stride_t + blk)
    rows = start + tl.arange(0, BLOCK_M)
    mask_m = rows < end
    pair = tl.load(order_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    return start < end, tl.load(table_ptr + blk).to(tl.int64), rows.to(tl.int64), mask_m, pair


# The block table's row stride follows the token count: not a reason to compile again.
@triton.jit(do_not_specialize=["stride_t"])
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, order_ptr, table_ptr, H, INTER, TOP_K,
                    stride_t, stride_xm, stride_we, stride_wn, stride_hm,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    live, e, rows, mask_m, pair = _block_rows(order_ptr, table_ptr, stride_t, BLOCK_M)
    if not live:
        return
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    w = w_ptr + e * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < H
        xt = tl.load(x_ptr + token[:, None] * stride_xm + kk[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wmask = mask_k[:, None] & mask_n[None, :]
        wg = tl.load(w + offs_n[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)
        wu = tl.load(w + (INTER + offs_n[None, :]) * stride_wn + kk[:, None], mask=wmask, other=0.0)
        gate = _mma(xt, wg, gate, PRECISION, WIDEN)
        up = _mma(xt, wu, up, PRECISION, WIDEN)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["stride_t"])
def _down_kernel(h_ptr, w_ptr, out_ptr, weights_ptr, order_ptr, table_ptr, H, INTER,
                 stride_t, stride_hm, stride_we, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    live, e, rows, mask_m, pair = _block_rows(order_ptr, table_ptr, stride_t, BLOCK_M)
    if not live:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    w = w_ptr + e * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < INTER
        ht = tl.load(h_ptr + rows[:, None] * stride_hm + kk[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wt = tl.load(w + offs_n[None, :] * stride_wn + kk[:, None],
                     mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _mma(ht, wt, acc, PRECISION, WIDEN)
    acc *= tl.load(weights_ptr + pair, mask=mask_m, other=0.0)[:, None]
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows a block takes: about three times the mean pairs per expert (so one block
    usually holds all of a touched expert's pairs), 16 to 128."""
    return min(128, max(16, triton.next_power_of_2(-(-3 * num_pairs // num_experts))))


# Launch shapes where the card has no tuned table (moe_configs.py); `fused_moe(config=...)`
# overrides both (benchmarks/moe_kernels.py, moe_tune.py). BLOCK_M None: block_m_for; BLOCK_K
# None: by BLOCK_M; "down": the down projection's own BLOCK_N/BLOCK_K/warps/stages; in_order:
# each token's k outputs added one after the other in slot order (torch's sum over them picks
# its split from T).
DEFAULT_CONFIG = dict(BLOCK_M=None, BLOCK_N=64, BLOCK_K=None, warps=4, stages=3, in_order=False)
# The batch-invariant mode's: one block shape whatever the batch, so every pair's products
# walk K in the same tiles; a row's bits do not follow the rows beside it in its block.
INVARIANT_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, warps=4, stages=3, in_order=True)


def _launch(cfg: dict, block_m: int) -> dict:
    """One kernel's tile and launch arguments from a config."""
    # Longer K tiles pay off while blocks are short (decode); measured in RESULTS.md.
    block_k = cfg["BLOCK_K"] or (128 if block_m <= 32 else 64)
    return dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, num_warps=cfg["warps"], num_stages=cfg["stages"])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """ops/moe.fused_moe on Triton: x [T, H], w13 [E, 2I, H], w2 [E, H, I] (last dims
    contiguous), topk_weights [T, k] float32, topk_ids [T, k] int32 -> [T, H] in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    m = num_tokens * top_k
    if m == 0:
        return x.new_zeros(num_tokens, hidden)
    if config is None:
        config = moe_configs.tuned(x.device, num_experts, hidden, inter, x.dtype, num_tokens)
    cfg: dict[str, Any] = DEFAULT_CONFIG if config is None else {**DEFAULT_CONFIG, **config}
    blocks = align(topk_ids, num_experts, cfg["BLOCK_M"] or block_m_for(m, num_experts))
    num_blocks = blocks.table.shape[1]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    up = _launch(cfg, blocks.block_m)
    down = _launch({**cfg, **cfg.get("down", {})}, blocks.block_m)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, up["BLOCK_N"]))](
        x, w13, h, blocks.order, blocks.table, hidden, inter, top_k,
        blocks.table.stride(0), x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=blocks.block_m, PRECISION=precision, WIDEN=_WIDEN, **up)
    out = torch.empty(num_tokens, top_k, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float()
    _down_kernel[(num_blocks, triton.cdiv(hidden, down["BLOCK_N"]))](
        h, w2, out, weights, blocks.order, blocks.table, hidden, inter,
        blocks.table.stride(0), h.stride(0), w2.stride(0), w2.stride(1), hidden,
        BLOCK_M=blocks.block_m, PRECISION=precision, WIDEN=_WIDEN, **down)
    if not cfg["in_order"]:
        return out.sum(dim=1).to(x.dtype)
    total = out[:, 0]
    for j in range(1, top_k):
        total = total + out[:, j]
    return total.to(x.dtype)
