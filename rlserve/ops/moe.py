"""Mixture-of-experts: the router's top-k choice, and the torch reference of the expert
computation (the CPU path, and the oracle the Triton kernel is tested against).

Expert weights are stacked per layer, as transformers 5 holds them: `w13 [E, 2I, H]` (each
expert's gate rows, then its up rows) and `w2 [E, H, I]`. Under tensor parallelism I is
this rank's slice of every expert, and the output is a partial sum the layer all-reduces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlserve.ops.fused_ref import silu_and_mul


class Routing(NamedTuple):
    """Per token, the experts it goes to and the weight of each one's output."""

    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor  # [T, k] int32


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """transformers' router: softmax over the experts in float32, the top k, and (with
    `renormalize`, norm_topk_prob) those k weights scaled to sum to one."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, ids.to(torch.int32))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """sum_j topk_weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ x[t]) with e = topk_ids[t, j]:
    [T, H] in x's dtype. One pass per expert over the tokens routed to it, as transformers
    loops; each expert's output is weighted, then summed in float32, experts in id order.
    `linear`: the expert GEMMs (the batch-invariant mode passes its own)."""
    num_tokens, k = topk_ids.shape
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1).float()
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // k
        h = silu_and_mul(linear(x[tokens], w13[expert]))
        y = linear(h, w2[expert])
        out.index_add_(0, tokens, y.float() * weights[pairs, None])
    return out.to(x.dtype)
