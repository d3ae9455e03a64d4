"""The fused elementwise Triton kernels (RMSNorm, add+RMSNorm, SiLU-and-mul) and the decode
GEMMs with their neighbours folded in, against the torch reference.

Needs CUDA and triton; skipped otherwise. With RLSERVE_TRITON_INTERPRET=1 the kernels run
on CPU tensors through Triton's interpreter instead.
"""

from __future__ import annotations

import pytest
import torch

from helpers.triton_lane import DEVICE, EXACT, INTERPRET, KERNEL_MARKS, TOL, rel_err
from rlserve.ops import fused_ref

pytestmark = KERNEL_MARKS


@pytest.mark.parametrize("hidden", [64, 200, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_add_rms_norm(hidden, dtype):
    from rlserve.ops import triton_fused
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, 3, hidden, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(5, 3, hidden, generator=gen).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    normed, new_res = triton_fused.fused_add_rms_norm(x, res, w, 1e-6)
    exp_normed, exp_res = fused_ref.fused_add_rms_norm(x, res, w, 1e-6)
    assert new_res.shape == x.shape and normed.dtype == exp_normed.dtype
    torch.testing.assert_close(new_res, exp_res, **EXACT)
    torch.testing.assert_close(normed, exp_normed, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(triton_fused.rms_norm(x, w, 1e-6), fused_ref.rms_norm(x, w, 1e-6),
                               rtol=TOL[dtype], atol=TOL[dtype])
    # In place: outputs land in the inputs' storage.
    x2, r2 = x.clone(), res.clone()
    a, b = triton_fused.fused_add_rms_norm(x2, r2, w, 1e-6, inplace=True)
    assert a.data_ptr() == x2.data_ptr() and b.data_ptr() == r2.data_ptr()
    torch.testing.assert_close(b, exp_res, **EXACT)
    torch.testing.assert_close(a, exp_normed, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("inter", [96, 3072])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_and_mul(inter, dtype):
    from rlserve.ops import triton_fused
    gen = torch.Generator().manual_seed(inter)
    x = (3 * torch.randn(4, 3, 2 * inter, generator=gen)).to(dtype).to(DEVICE)
    out = triton_fused.silu_and_mul(x)
    expected = fused_ref.silu_and_mul(x)
    assert out.shape == (4, 3, inter)
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])
    # A non-contiguous input (every other row).
    xs = x[::2]
    torch.testing.assert_close(triton_fused.silu_and_mul(xs), fused_ref.silu_and_mul(xs),
                               rtol=TOL[dtype], atol=TOL[dtype])


# ------------------------------------------------------ decode GEMMs with their neighbours


def _gemm_inputs(rows: int, k: int, n: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype).to(DEVICE)
    return x, w


@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_decode_gemm_matches_the_product(rows, splits):
    """Split-K partial sums add up to x @ w.T; unsplit, the product rounded once."""
    from rlserve.ops import triton_decode_gemm as G
    x, w = _gemm_inputs(rows, 512, 64, torch.bfloat16, rows * 10 + splits)
    plan = G.GemmPlan(bn=32, bm=G._bm(rows), bk=128, splits=splits, stages=2, warps=4)
    out = G.decode_gemm(x, w, plan)
    exact = x.float() @ w.float().T
    if splits > 1:
        assert out.shape == (splits, rows, 64) and out.dtype == torch.float32
        torch.testing.assert_close(out.sum(0), exact, rtol=1e-4, atol=1e-4)
    else:
        assert out.shape == (rows, 64) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out, exact.to(torch.bfloat16), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("rows", [3, 64, 260])
def test_linear_add_rms_norm_matches_linear_then_norm(rows):
    """The kernel set's fused projection + residual add + RMSNorm gives what F.linear and
    fused_add_rms_norm give, through split-K partials at decode sizes (and cuBLAS above)."""
    from rlserve.ops import kernels
    from rlserve.ops import triton_decode_gemm as G
    dtype = torch.bfloat16
    x, w = _gemm_inputs(rows, 1024, 256, dtype, rows)
    gen = torch.Generator().manual_seed(rows + 1)
    residual = torch.randn(rows, 256, generator=gen).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(256, generator=gen)).to(dtype).to(DEVICE)
    plan = G.plan_o_down(rows, 1024, 256)
    assert (plan is not None and plan.splits > 1) == (rows <= 256)
    normed, total = kernels._triton().linear_add_rms_norm(x, w, residual, norm_w, 1e-6)
    exp_normed, exp_total = fused_ref.fused_add_rms_norm(torch.nn.functional.linear(x, w), residual, norm_w, 1e-6)
    assert normed.shape == total.shape == (rows, 256) and normed.dtype == total.dtype == dtype
    # The product's summation order differs from the reference's: compared row by row.
    assert rel_err(total, exp_total) < TOL[dtype] and rel_err(normed, exp_normed) < TOL[dtype]


@pytest.mark.parametrize("rows", [2, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_silu_and_mul_matches_linear_then_activation(rows, dtype):
    """gate_up_proj with SiLU-and-mul in its epilogue, against F.linear then silu_and_mul
    (float32 and large batches keep cuBLAS and the activation kernel)."""
    from rlserve.ops import kernels
    x, w = _gemm_inputs(rows, 256, 2 * 96, dtype, rows)
    out = kernels._triton().linear_silu_and_mul(x, w)
    expected = fused_ref.silu_and_mul(torch.nn.functional.linear(x, w))
    assert out.shape == (rows, 96) and out.dtype == dtype
    # Summation order and a few roundings apart: compared row by row (the interpreter
    # truncates at each of them, so it drifts further).
    assert rel_err(out, expected) < TOL[dtype] * (2 if INTERPRET else 1)

