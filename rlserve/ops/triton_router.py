"""The MoE router in one launch: softmax over the experts in float32, the top k, and the
renormalisation of their weights, for every token at once.

torch spends five to seven launches a layer on it (softmax, a top-k gather and its sort, a
sum, a division, an int32 copy): on Qwen3-30B-A3B, 2-3% of a run's device time, as much as
the sort of the pairs by expert. Here one program takes one token's row of logits into
registers (up to 1,024 experts), and picks the k largest probabilities by k argmax passes,
the lowest expert first among equals. A row's result depends on that row alone, so it is
batch invariant.

Same semantics as ops/moe.py's `route` (transformers' router); the probabilities may differ
from torch's in the last bit (the sum's order), which can swap two experts whose
probabilities are equal to the last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlserve.ops import moe

MAX_EXPERTS = 1024  # a row in registers; more experts take the torch router


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    x = tl.load(logits_ptr + row * stride + cols, mask=valid, other=-float("inf")).to(tl.float32)
    e = tl.where(valid, tl.exp(x - tl.max(x, 0)), 0.0)
    p = e / tl.sum(e, 0)
    p = tl.where(valid, p, -1.0)  # padding never wins
    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        # The lowest index holding the maximum: ties go to the lower expert.
        first = tl.min(tl.where(p == best, cols, BLOCK_E), 0)
        weights = tl.where(slot == j, best, weights)
        ids = tl.where(slot == j, first, ids)
        p = tl.where(cols == first, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(slot < TOP_K, weights, 0.0), 0)
    out = row * TOP_K + slot
    tl.store(weights_ptr + out, weights, mask=slot < TOP_K)
    tl.store(ids_ptr + out, ids, mask=slot < TOP_K)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> moe.Routing:
    """logits [T, E] (any float dtype) -> Routing: weights [T, k] float32, ids [T, k] int32."""
    tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"route: top_k {top_k} of {experts} experts")
    if experts > MAX_EXPERTS:  # a row no longer fits in registers
        return moe.route(logits, top_k, renormalize)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens:
        block_e = triton.next_power_of_2(experts)
        # A warp per 128 experts: the k passes' reductions stay in warp shuffles for up to 128.
        _route_kernel[(tokens,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                                 BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
                                 RENORMALIZE=renormalize, num_warps=max(1, min(8, block_e // 128)))
    return moe.Routing(weights, ids)
