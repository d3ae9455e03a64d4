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
def _gumbel_argmax_kernel(logits_ptr, stride_row, inv_temp_ptr, seed_ptr, out_ptr, vocab,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    inv_temp = tl.load(inv_temp_ptr + row)
    seed = tl.load(seed_ptr + row)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
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
    tl.store(out_ptr + row, idx.to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [R, V] at `temperature` [R] (> 0), noise keyed by `seeds` [R]."""
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        inv_temp = (1.0 / temperature.float()).contiguous()
        _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), inv_temp, seeds, out, vocab,
                                       BLOCK=2048, num_warps=8)
    return out
