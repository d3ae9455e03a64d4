"""Small fused Triton kernels: RMSNorm (optionally with the residual add, whose addend may
arrive as a split-K GEMM's partial sums) and SiLU-and-mul.

Arithmetic and rounding points match rlserve.ops.fused_ref (transformers' Llama/Qwen
modules), so outputs agree with the torch path up to float32 summation order.
Importing this module imports triton; callers import it lazily, only on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rlserve.ops import triton_pdl
from rlserve.ops.triton_pdl import release_next, wait_for_previous


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if SPLITS > 0:
        # x arrives as float32 partial sums [SPLITS, n_rows, n_cols], summed in split order
        # and rounded once to the activation dtype, as the GEMM's own output would be.
        acc = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(x_ptr + (s * n_rows + row) * n_cols + cols, mask=mask, other=0.0)
        x = acc.to(res_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The sum is rounded to the activation dtype before the norm reads it, as in torch.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / n_cols
    h = (h * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _norm_launch(x, residual, weight, eps, out, res_out, splits: int = 0):
    """splits > 0: x is [splits, rows, cols] float32 partial sums (contiguous)."""
    n_cols = x.shape[-1]
    block = triton.next_power_of_2(n_cols)
    num_warps = min(16, max(1, block // 256))
    rows = x.shape[-2]
    if rows == 0:
        return
    pdl = triton_pdl.enabled(x.device)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out,
        res_out if res_out is not None else out,
        x.stride(-2), residual.stride(0) if residual is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0, rows, n_cols, eps,
        HAS_RESIDUAL=residual is not None, SPLITS=splits, BLOCK=block, PDL=pdl, num_warps=num_warps,
        **triton_pdl.launch_options(pdl),
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    _norm_launch(x2, None, weight.contiguous(), eps, out, None)
    return out.view(shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, *, inplace: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual).

    inplace=True writes the normed value into x and the sum into residual (both must be
    contiguous) and returns them, saving two allocations.
    """
    assert x.shape == residual.shape
    shape = x.shape
    x2, r2 = _rows(x), _rows(residual)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if inplace:
        assert x.is_contiguous() and residual.is_contiguous() and out_dtype == x.dtype
        out, res_out = x2, r2
    else:
        out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        res_out = torch.empty_like(x2)
    _norm_launch(x2, r2, weight.contiguous(), eps, out, res_out)
    return out.view(shape), res_out.view(shape)


def partials_add_rms_norm(partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm(x, residual) where x = partials.sum(0) rounded to residual's dtype:
    partials [splits, rows, cols] float32, a split-K GEMM's (triton_decode_gemm)."""
    assert partials.is_contiguous() and partials.dtype == torch.float32 and residual.is_contiguous()
    splits, rows, cols = partials.shape
    assert residual.shape == (rows, cols)
    out = torch.empty((rows, cols), dtype=torch.promote_types(residual.dtype, weight.dtype),
                      device=residual.device)
    res_out = torch.empty_like(residual)
    _norm_launch(partials, residual, weight.contiguous(), eps, out, res_out, splits)
    return out, res_out


@triton.jit
def silu_mul(g, u):
    """silu(g) * u in float32 for g, u in the activation dtype; silu is rounded to that
    dtype before the multiply, as F.silu(a) * b does. Shared by the SiLU-and-mul kernel
    and the gate_up GEMM that applies it in its epilogue (triton_decode_gemm)."""
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return a.to(tl.float32) * u.to(tl.float32)


@triton.jit
def silu_mul_exact(g, u):
    """silu_mul with torch's own functions: CUDA's expf and an IEEE division (the batch-
    invariant mode's bits: a trainer's F.silu(gate) * up)."""
    gf = g.to(tl.float32)
    a = libdevice.div_rn(gf, 1.0 + libdevice.exp(-gf)).to(g.dtype)
    return a.to(tl.float32) * u.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr,
                         PDL: tl.constexpr, EXACT: tl.constexpr):
    release_next(PDL)  # the down projection after it launches early and waits (triton_pdl)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    if EXACT:
        y = silu_mul_exact(g, u)
    else:
        y = silu_mul(g, u)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """x: [..., 2 * I] -> silu(x[..., :I]) * x[..., I:]. exact (CUDA): torch's bits."""
    n = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, PDL=triton_pdl.enabled(x.device),
            EXACT=exact, num_warps=4 if block >= 512 else 2, enable_fp_fusion=not exact,
        )
    return out.view(*x.shape[:-1], n)
