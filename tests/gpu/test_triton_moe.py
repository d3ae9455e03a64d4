"""The Triton fused MoE against the torch reference (ops/moe.py) on fresh random inputs.

Needs CUDA and triton; with RLSERVE_TRITON_INTERPRET=1 it runs on the CPU through Triton's
interpreter (small shapes).
"""

from __future__ import annotations

import pytest
import torch

from helpers.triton_lane import DEVICE, INTERPRET, KERNEL_MARKS
from rlserve.ops import moe as ref

pytestmark = KERNEL_MARKS


def _kernel():
    from rlserve.ops import triton_moe
    return triton_moe


def _case(tokens, experts, top_k, hidden, inter, dtype, seed, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:  # most tokens to expert 0: one expert's run spans many blocks
        logits[:, 0] += 8.0
    routing = ref.route(logits, top_k, renormalize=True)
    return [t.to(DEVICE) for t in (x, w13, w2, routing.weights, routing.ids)]


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 8, 2), (37, 60, 4), (300, 16, 8)])
def test_align_sorts_pairs_stably_by_expert_and_blocks_cover_them(tokens, experts, top_k):
    kernel = _kernel()
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(tokens))
    blocks = kernel.align(ids.to(torch.int32).to(DEVICE), experts, block_m=16)
    flat = ids.reshape(-1)
    assert blocks.order.cpu().tolist() == torch.argsort(flat, stable=True).tolist()
    covered = []
    for e, start, end in zip(*blocks.table.cpu().tolist()):
        if start < end:
            rows = list(range(start, min(start + 16, end)))
            assert all(flat[blocks.order[r]].item() == e for r in rows)
            covered += rows
    assert covered == list(range(flat.numel()))  # every row once, in order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,skew", [
    (1, 8, 2, 64, 32, False), (7, 8, 2, 96, 48, False), (64, 60, 4, 64, 96, False),
    (200, 16, 8, 128, 64, False), (150, 8, 2, 64, 32, True)])
def test_fused_moe_matches_the_reference(tokens, experts, top_k, hidden, inter, skew, dtype):
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter, dtype, seed=tokens, skew=skew)
    got = _kernel().fused_moe(x, w13, w2, weights, ids)
    want = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    assert err.max().item() < (1e-4 if dtype == torch.float32 else 2e-2)


# Shapes a tuned table may give (moe_configs.py): each projection its own tiles and warps.
TUNED_SHAPES = [dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, warps=4, stages=4, down=dict(BLOCK_N=128, BLOCK_K=64)),
                dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, warps=8, stages=3, down=dict(BLOCK_N=64, warps=4)),
                dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, warps=4, stages=2)]


@pytest.mark.parametrize("config", TUNED_SHAPES)
def test_every_tuned_launch_shape_gives_the_reference(config):
    x, w13, w2, weights, ids = _case(37, 8, 2, 96, 48, torch.bfloat16, seed=5)
    got = _kernel().fused_moe(x, w13, w2, weights, ids, config=config)
    want = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    assert err.max().item() < 2e-2


@pytest.mark.skipif(INTERPRET, reason="too large for the interpreter")
@pytest.mark.parametrize("tokens,experts,top_k", [(8192, 128, 8), (2048, 64, 6), (513, 128, 8)])
def test_fused_moe_matches_the_reference_at_prefill_sizes(tokens, experts, top_k):
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, 256, 128, torch.bfloat16, seed=tokens)
    got = _kernel().fused_moe(x, w13, w2, weights, ids)
    want = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    assert err.max().item() < 2e-2


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need CUDA")
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    """The launch shape depends on the token count only: a captured step gives the right
    answer for routing it was not captured with."""
    x, w13, w2, weights, ids = _case(16, 32, 4, 128, 64, torch.bfloat16, seed=1)
    kernel = _kernel()
    kernel.fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.fused_moe(x, w13, w2, weights, ids)
    fresh = _case(16, 32, 4, 128, 64, torch.bfloat16, seed=2)
    for buf, new in zip((x, w13, w2, weights, ids), fresh):
        buf.copy_(new)
    graph.replay()
    want = kernel.fused_moe(*fresh)
    assert torch.equal(out, want)
