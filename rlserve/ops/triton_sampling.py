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


# Sizes change with every batch: specialising on them (== 1, divisible by 16) would compile
# a new variant mid-run, hundreds of milliseconds each.
@triton.jit(do_not_specialize=["stride_row", "vocab", "num_splits", "chunk"])
def _gumbel_argmax_partial_kernel(logits_ptr, stride_row, inv_temp_ptr, seed_ptr, val_ptr, idx_ptr,
                                  vocab, num_splits, chunk, BLOCK: tl.constexpr):
    """Program (row, split): the best of logits / T + G over columns split*chunk.. +chunk.
    `chunk` is a runtime value: batch sizes change every step and must not recompile."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    inv_temp = tl.load(inv_temp_ptr + row)
    seed = tl.load(seed_ptr + row)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for off in range(0, chunk, BLOCK):
        cols = split * chunk + off + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, cols)
        u = tl.maximum(u, 1e-10)  # rand is in [0, 1): keep log finite
        g = -tl.log(-tl.log(u))
        v = tl.where(mask, x * inv_temp + g, float("-inf"))
        better = v > best_val
        best_val = tl.where(better, v, best_val)
        best_idx = tl.where(better, cols, best_idx)
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
    """One token per row of logits [R, V] at `temperature` [R] (> 0), noise keyed by `seeds` [R].

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
    inv_temp = (1.0 / temperature.float()).contiguous()
    vals = torch.empty((rows, splits), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((rows, splits), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_partial_kernel[(rows, splits)](logits, logits.stride(0), inv_temp, seeds, vals, idxs,
                                                  vocab, splits, chunk, BLOCK=_BLOCK, num_warps=4)
    _argmax_of_splits_kernel[(rows,)](vals, idxs, out, splits, SPLITS=_MAX_SPLITS, num_warps=1)
    return out
