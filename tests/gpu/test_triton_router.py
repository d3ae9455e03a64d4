"""The one-launch MoE router (ops/triton_router.py) against the torch router (ops/moe.py) on
fresh random logits: the same experts in the same order, the same weights to float32's last
bits, ties to the lower expert, and each row's result independent of the rows beside it.

Needs CUDA and triton; with RLSERVE_TRITON_INTERPRET=1 it runs on the CPU through Triton's
interpreter.
"""

from __future__ import annotations

import pytest
import torch

from helpers.triton_lane import DEVICE, KERNEL_MARKS
from rlserve.ops import moe as ref

pytestmark = KERNEL_MARKS


def _route(logits, top_k, renormalize):
    from rlserve.ops import triton_router
    return triton_router.route(logits, top_k, renormalize)


# (tokens, experts, top_k): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE-like, Qwen3-Next
SHAPES = [(1, 8, 2), (7, 60, 4), (33, 128, 8), (5, 64, 8), (9, 512, 10)]


@pytest.mark.parametrize("tokens,experts,top_k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_picks_torchs_experts_and_weights(tokens, experts, top_k, dtype, renormalize):
    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    # A permutation per row in steps of 1/8 (exact in bfloat16 up to 512 experts): distinct
    # logits, so no tie decides.
    perms = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)])
    logits = (perms - experts // 2).float() / 8
    logits = logits.to(dtype).to(DEVICE)
    want = ref.route(logits, top_k, renormalize)
    got = _route(logits, top_k, renormalize)
    assert got.ids.dtype == torch.int32 and got.weights.dtype == torch.float32
    assert got.ids.cpu().tolist() == want.ids.cpu().tolist()
    torch.testing.assert_close(got.weights.cpu(), want.weights.cpu(), rtol=2e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert_and_padding_never_wins():
    logits = torch.zeros(3, 6)
    logits[0, [1, 4]] = 2.0  # two equal maxima: 1 before 4, then the lowest of the zeros
    logits[1] = -30.0  # all equal and tiny: 0, 1, 2
    logits[2, 5] = 1.0
    got = _route(logits.to(DEVICE), 3, renormalize=True)
    assert got.ids.cpu().tolist() == [[1, 4, 0], [0, 1, 2], [5, 0, 1]]
    torch.testing.assert_close(got.weights[1].cpu(), torch.full((3,), 1 / 3))


def test_a_rows_routing_does_not_depend_on_its_neighbours():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    whole = _route(logits, 8, True)
    for lo, hi in ((0, 1), (3, 20), (39, 40)):
        part = _route(logits[lo:hi], 8, True)
        assert torch.equal(part.ids, whole.ids[lo:hi]) and torch.equal(part.weights, whole.weights[lo:hi])


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="top_k 9 of 8 experts"):
        _route(torch.zeros(2, 8, device=DEVICE), 9, True)
