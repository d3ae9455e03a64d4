"""Temperature sampling on CUDA: an exact two-level Gumbel-max draw.

argmax(logits / T + G), with G i.i.d. standard Gumbel noise, is a draw from
softmax(logits / T), so no probability tensor is materialised. Drawing G for every column
makes that compute-bound (Philox and two logs per column, ~15x the cost of reading the
logits), so the draw is split in two levels:

1. The vocabulary is cut into splits of SPLIT_COLUMNS columns. One program per (row, split)
   reads its columns once and writes the split's log-sum-exp, log Z_s of logits / T: a
   memory-bound pass with no noise.
2. One program per row picks a split by Gumbel-max over the log Z_s, which selects split s
   with probability Z_s / Z, then a column by Gumbel-max over logits / T inside that split
   only, which selects column i with probability exp(x_i / T) / Z_s. The two noises are
   independent (disjoint Philox counters), so column i comes out with probability
   exp(x_i / T) / Z: the same distribution as the one-level draw, with only
   SPLIT_COLUMNS + V / SPLIT_COLUMNS noise values per row instead of V.

The noise comes from Philox keyed by the row's seed, and the splits are a fixed number of
columns, so a seeded request gets the same token whatever else is in the batch. Everything
is in base 2 (exp2 / log2 are the native instructions): that scales logits and Gumbel noise
alike, which leaves each argmax unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per split, fixed so that a row's draw never depends on the batch. On an H200,
# 256 x 151,936 bf16: 2048 gives ~24 us for the log-sum-exp pass and ~5 us for the draw;
# 8192 costs the same pass and ~11 us of draw (four times the noise).
SPLIT_COLUMNS = 2048
_BLOCK = 2048  # most columns per step of the draw inside a split
_SPLIT_BLOCK = 128  # splits per step of the split choice: one step for a 256k vocabulary


@triton.jit
def _gumbel2(u):
    """Gumbel noise in base 2, -log2(-log2(u)), from uniform u in [0, 1).

    Near u = 1 the approximate log2 loses its relative accuracy (and can return 0, i.e.
    infinite noise); -log2(1 - d) >= d * log2(e) is also its first-order value there, so the
    bound repairs exactly that range. u = 0 gives -inf: that column never wins.
    """
    e = tl.maximum(-tl.log2(u), (1.0 - u) * 1.4426950408889634)
    return -tl.log2(e)


# Sizes change with every batch: specialising on them (== 1, divisible by 16) would compile
# a new variant mid-run, hundreds of milliseconds each.
@triton.jit(do_not_specialize=["stride_row", "vocab", "num_splits"])
def _split_logsumexp_kernel(logits_ptr, stride_row, temp_ptr, lse_ptr, vocab, num_splits,
                            CHUNK: tl.constexpr):
    """Program (row, split): log2 of sum(exp2(x * log2(e) / T)) over the split's columns.

    One load per element, issued at once, then a max and an exp2-sum: the pass stays
    memory-bound. A split with every column -inf stores -inf.
    """
    # One flat grid, a row's splits side by side: neighbouring programs read neighbouring
    # memory, and the row count has no grid-dimension limit.
    pid = tl.program_id(0)
    row = (pid // num_splits).to(tl.int64)
    split = pid % num_splits
    scale = 1.4426950408889634 / tl.load(temp_ptr + row).to(tl.float32)
    cols = split * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf"))
    x = x.to(tl.float32) * scale
    m = tl.max(x, 0)
    # An all -inf split subtracts 0 instead of m: -inf - -inf would be NaN. Otherwise s >= 1
    # (the maximum adds exp2(0)), so the clamp only keeps log2 off 0 for -inf splits.
    s = tl.sum(tl.exp2(x - tl.where(m == float("-inf"), 0.0, m)), 0)
    tl.store(lse_ptr + row * num_splits + split, m + tl.log2(tl.maximum(s, 1.0)))


@triton.jit
def _fold(row_ptr, cols, vocab, scale, u, best_val, best_idx):
    """Fold columns `cols`, with uniform noise `u`, into the running best (value, column)."""
    mask = cols < vocab
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    v = tl.where(mask, x * scale + _gumbel2(u), float("-inf"))
    better = v > best_val  # strict: the earlier column keeps a tie, as argmax does
    return tl.where(better, v, best_val), tl.where(better, cols, best_idx)


@triton.jit(do_not_specialize=["stride_row", "vocab", "num_splits"])
def _two_level_draw_kernel(logits_ptr, stride_row, temp_ptr, seed_ptr, lse_ptr, out_ptr, vocab,
                           num_splits, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                           SPLIT_BLOCK: tl.constexpr):
    """Program (row): a split by Gumbel-max over the log Z_s, then a column inside it.

    Columns take Philox counters below V / 4 with the high word 0 (four numbers per
    counter); split s takes counter s with the high word 1. The two sets never overlap, so
    the choice of split is independent of the noise inside it.
    """
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + row)
    scale = 1.4426950408889634 / tl.load(temp_ptr + row).to(tl.float32)

    # Level 1: the split. Blocks go up in order and only a strictly larger value replaces
    # the best, so the smallest index keeps a tie, as argmax does.
    best = float("-inf")
    split = 0
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        offs = s0 + tl.arange(0, SPLIT_BLOCK)
        mask = offs < num_splits
        lse = tl.load(lse_ptr + row * num_splits + offs, mask=mask, other=float("-inf"))
        u = tl.rand(seed, offs.to(tl.int64) + (1 << 32))
        v = tl.where(mask, lse + _gumbel2(u), float("-inf"))
        top = tl.max(v, 0)
        idx = tl.min(tl.where(v == top, offs, 2147483647), 0)
        split = tl.where(top > best, idx, split)
        best = tl.maximum(top, best)

    # Level 2: the column inside the split. One Philox call yields four numbers, for
    # columns base + i, base + Q + i, base + 2Q + i and base + 3Q + i of a BLOCK = 4Q block.
    Q: tl.constexpr = BLOCK // 4
    row_ptr = logits_ptr + row * stride_row
    lane = tl.arange(0, Q)
    best_val = tl.full([Q], float("-inf"), tl.float32)
    best_idx = tl.zeros([Q], tl.int32)
    for off in range(0, CHUNK, BLOCK):
        base = split * CHUNK + off
        u0, u1, u2, u3 = tl.rand4x(seed, base // 4 + lane)
        best_val, best_idx = _fold(row_ptr, base + lane, vocab, scale, u0, best_val, best_idx)
        best_val, best_idx = _fold(row_ptr, base + Q + lane, vocab, scale, u1, best_val, best_idx)
        best_val, best_idx = _fold(row_ptr, base + 2 * Q + lane, vocab, scale, u2, best_val, best_idx)
        best_val, best_idx = _fold(row_ptr, base + 3 * Q + lane, vocab, scale, u3, best_val, best_idx)
    top = tl.max(best_val, 0)
    # The smallest column among ties, as argmax does.
    tl.store(out_ptr + row, tl.min(tl.where(best_val == top, best_idx, 2147483647), 0).to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, *,
                  chunk: int = SPLIT_COLUMNS) -> torch.Tensor:
    """One token per row of logits [R, V] (bf16, fp16 or fp32, unit column stride) at
    `temperature` [R] (float32, > 0), noise keyed by `seeds` [R] (int64).

    `chunk`, the columns per split, is a power of two from 64 to 8192 (the first pass holds
    a whole split in registers); the draw of a seed depends on it, so only tests change it.
    """
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and 64 <= chunk <= 8192 and chunk & (chunk - 1) == 0
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    splits = triton.cdiv(vocab, chunk)
    lse = torch.empty((rows, splits), dtype=torch.float32, device=logits.device)
    _split_logsumexp_kernel[(rows * splits,)](logits, logits.stride(0), temperature, lse, vocab, splits,
                                              CHUNK=chunk, num_warps=2)
    _two_level_draw_kernel[(rows,)](logits, logits.stride(0), temperature, seeds, lse, out, vocab, splits,
                                    CHUNK=chunk, BLOCK=min(chunk, _BLOCK), SPLIT_BLOCK=_SPLIT_BLOCK, num_warps=4)
    return out
