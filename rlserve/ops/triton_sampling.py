"""Temperature sampling in one pass over the logits: the Gumbel-max trick.

argmax(logits / T + G), with G = -log(-log(U)) standard Gumbel noise, is a draw from
softmax(logits / T), so neither the softmax nor a probability tensor is materialised. The
noise comes from Philox keyed by a per-row seed and the column, so a seeded request gets the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_candidates(logits_ptr, row_off, cols, vocab, inv_temp, u, best_val, best_idx):
    """Fold columns `cols`, with uniform noise `u`, into the running best (value, column)."""
    mask = cols < vocab
    x = tl.load(logits_ptr + row_off + cols, mask=mask, other=float("-inf")).to(tl.float32)
    u = tl.maximum(u, 1e-10)  # rand is in [0, 1): keep log finite
    g = -tl.log(-tl.log(u))
    v = tl.where(mask, x * inv_temp + g, float("-inf"))
    better = v > best_val  # strict: the earlier column keeps a tie, as argmax does
    return tl.where(better, v, best_val), tl.where(better, cols, best_idx)


# Sizes change with every batch: specialising on them (== 1, divisible by 16) would compile
# a new variant mid-run, hundreds of milliseconds each.
@triton.jit(do_not_specialize=["stride_row", "vocab", "num_splits", "chunk"])
def _gumbel_argmax_partial_kernel(logits_ptr, stride_row, temp_ptr, seed_ptr, val_ptr, idx_ptr,
                                  vocab, num_splits, chunk, BLOCK: tl.constexpr):
    """Program (row, split): the best of logits / T + G over columns split*chunk.. +chunk.

    The noise is the cost here, not the bytes: one Philox call yields four numbers, for
    columns base + i, base + Q + i, base + 2Q + i and base + 3Q + i of a BLOCK = 4Q block,
    counter base / 4 + i. Chunks are whole blocks, so a column's noise does not depend on
    the split.
    """
    Q: tl.constexpr = BLOCK // 4
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    inv_temp = 1.0 / tl.load(temp_ptr + row).to(tl.float32)
    seed = tl.load(seed_ptr + row)
    row_off = row * stride_row
    best_val = tl.full([Q], float("-inf"), tl.float32)
    best_idx = tl.zeros([Q], tl.int32)
    lane = tl.arange(0, Q)
    for off in range(0, chunk, BLOCK):
        base = split * chunk + off
        u0, u1, u2, u3 = tl.rand4x(seed, base // 4 + lane)
        cols = base + lane
        best_val, best_idx = _gumbel_candidates(logits_ptr, row_off, cols, vocab, inv_temp, u0, best_val, best_idx)
        best_val, best_idx = _gumbel_candidates(logits_ptr, row_off, cols + Q, vocab, inv_temp, u1, best_val, best_idx)
        best_val, best_idx = _gumbel_candidates(logits_ptr, row_off, cols + 2 * Q, vocab, inv_temp, u2, best_val, best_idx)
        best_val, best_idx = _gumbel_candidates(logits_ptr, row_off, cols + 3 * Q, vocab, inv_temp, u3, best_val, best_idx)
    top = tl.max(best_val, 0)
    # The smallest column among ties, as argmax does.
    idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), 0)
    tl.store(val_ptr + row * num_splits + split, top)
    tl.store(idx_ptr + row * num_splits + split, idx)


@triton.jit(do_not_specialize=["num_splits"])
def _argmax_of_splits_kernel(val_ptr, idx_ptr, out_ptr, num_splits, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SPLITS)
    mask = offs < num_splits
    v = tl.load(val_ptr + row * num_splits + offs, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_splits + offs, mask=mask, other=2147483647)
    top = tl.max(v, 0)
    tl.store(out_ptr + row, tl.min(tl.where(v == top, i, 2147483647), 0).to(tl.int64))


_BLOCK = 1024
_TARGET_PROGRAMS = 2048  # enough to fill the GPU: one program per row alone leaves it idle
_MAX_SPLITS = 128  # one compiled variant of the second kernel serves every split count


def num_splits_for(rows: int, vocab: int) -> int:
    blocks = triton.cdiv(vocab, _BLOCK)
    return max(1, min(blocks, triton.cdiv(_TARGET_PROGRAMS, max(rows, 1)), _MAX_SPLITS))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  num_splits: int | None = None) -> torch.Tensor:
    """One token per row of logits [R, V] at `temperature` [R] (> 0, contiguous), noise keyed
    by `seeds` [R].

    Each row's vocabulary is split over several programs (the noise of a column does not
    depend on the split), then one small kernel picks each row's best split.
    """
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    splits = min(num_splits or num_splits_for(rows, vocab), _MAX_SPLITS)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), _BLOCK) * _BLOCK
    splits = triton.cdiv(vocab, chunk)
    # One buffer for both halves of each row's partial results (fewer host-side calls).
    part = torch.empty((2, rows, splits), dtype=torch.float32, device=logits.device)
    vals, idxs = part[0], part[1].view(torch.int32)
    _gumbel_argmax_partial_kernel[(rows, splits)](logits, logits.stride(0), temperature, seeds, vals, idxs,
                                                  vocab, splits, chunk, BLOCK=_BLOCK, num_warps=4)
    _argmax_of_splits_kernel[(rows,)](vals, idxs, out, splits, SPLITS=_MAX_SPLITS, num_warps=1)
    return out
