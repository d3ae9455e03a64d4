"""GEMMs for decode batches, with their neighbours fused: few rows of activations against a
layer's weights.

At decode batch sizes a projection's weights (2-12 MB a layer for Qwen3-0.6B) are read
once and the arithmetic is small, so what sets the time is how many programs stream the
weights at once. cuBLAS tiles the output, and a 1024-wide output (o_proj, down_proj) gives
it a few dozen tiles for 132 SMs. Here the weight rows fill the MMA's wide side, the
batch its narrow side, and the reduction dimension is split across programs (split-K)
until there is about a program per SM. The partial sums are not reduced by a kernel of
their own: the RMSNorm that follows (with its residual add) reads and sums them
(triton_fused.partials_add_rms_norm). gate_up_proj computes the gate and up rows of one
output tile side by side and writes silu(gate) * up, so the activation kernel and the
[rows, 2 x intermediate] tensor between them go away. On sm_90 these GEMMs launch while
the kernel before them finishes (triton_pdl).

Rounding follows the unfused path: the product is rounded to the activation dtype once
(as cuBLAS rounds its float32 accumulator), before the residual add or the activation,
so the two paths differ only by float32 summation order.

Which shapes take these kernels, and their tiles, is `plan_o_down` / `plan_gate_up`:
chosen from the row count, the only size that changes between calls (CUDA graphs are
captured per batch size, so one graph always runs one plan). Tuned on an H200 with
benchmarks/decode_gemm.py (its sweep of tiles, for Qwen3-0.6B's and Llama-3.1-8B's
shapes).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rlserve.ops import triton_fused, triton_pdl
from rlserve.ops.triton_fused import silu_mul
from rlserve.ops.triton_pdl import release_next, wait_for_previous


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:  # Triton's CPU interpreter mis-evaluates bf16 dots: fp32 operands there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M"])
def _decode_gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    GATED: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    """out = x @ w.T for an [M, K] x. Program (n, k, m) computes weight rows
    [n * BN, (n + 1) * BN) against rows [m * BM, (m + 1) * BM) of x over the k-th of
    SPLIT_K slices of K.

    SPLIT_K > 1: float32 partial sums to out [SPLIT_K, M, N]. GATED: w holds N gate rows then
    N up rows; out [M, N] = silu(x @ gate.T) * (x @ up.T). Else: out [M, N] in out's dtype.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    k_len = K // SPLIT_K
    rk = pid_k * k_len + tl.arange(0, BK)
    m_ok = rm < M
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    acc_up = tl.zeros([BN, BM], dtype=tl.float32)
    up_ptrs = w_ptrs + N.to(tl.int64) * stride_wn
    # Launched early under PDL (triton_pdl): everything below reads activations.
    wait_for_previous(PDL)
    release_next(PDL)
    for _ in range(0, k_len, BK):
        xt = tl.trans(tl.load(x_ptrs, mask=m_ok[:, None], other=0.0))
        acc = _dot(tl.load(w_ptrs), xt, acc, DOT_F32)
        if GATED:
            acc_up = _dot(tl.load(up_ptrs), xt, acc_up, DOT_F32)
            up_ptrs += BK
        w_ptrs += BK
        x_ptrs += BK
    dtype = x_ptr.dtype.element_ty
    if GATED:
        # As silu_and_mul over gate_up's output, which would be rounded to dtype first.
        y = silu_mul(acc.to(dtype), acc_up.to(dtype))
        tl.store(out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None],
                 y.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
    elif SPLIT_K == 1:
        tl.store(out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
    else:
        tl.store(out_ptr + (pid_k * M + rm[None, :]).to(tl.int64) * N + rn[:, None], acc,
                 mask=m_ok[None, :])


class GemmPlan(NamedTuple):
    """Tiles of one decode GEMM: BN weight rows by BM batch rows, BK deep, K in `splits`."""

    bn: int
    bm: int
    bk: int
    splits: int
    stages: int
    warps: int


def _fits(plan: GemmPlan, k: int, n: int) -> bool:
    return n % plan.bn == 0 and k % (plan.splits * plan.bk) == 0


def _bm(rows: int) -> int:
    return max(16, min(64, triton.next_power_of_2(rows)))


@functools.cache
def plan_o_down(rows: int, k: int, n: int) -> GemmPlan | None:
    """Tiles for a projection whose output feeds an RMSNorm (o_proj, down_proj), or None
    where cuBLAS and a separate norm are as fast. About one program a SM: a narrow output
    (Qwen3-0.6B's 1024) takes four K slices at few rows and two otherwise, and pays up to
    256 rows; a wide one (Llama-3.1-8B's 4096) gives cuBLAS enough tiles from 128 rows on
    (at 192 it is 1.5-2x faster than any split here)."""
    narrow = n <= 2048
    if rows > (256 if narrow else 64):
        return None
    if rows <= 32 and narrow:
        plan = GemmPlan(bn=32, bm=_bm(rows), bk=128, splits=4, stages=4, warps=4)
    elif rows <= 64 and narrow:
        plan = GemmPlan(bn=16, bm=64, bk=128, splits=2, stages=4, warps=4)
    else:  # long K slices (Llama's down_proj) stream better in deeper tiles at few rows
        bk = 256 if k >= 8192 and rows <= 16 else 128
        plan = GemmPlan(bn=64, bm=_bm(rows), bk=bk, splits=2, stages=4, warps=4)
    return plan if _fits(plan, k, n) else None


@functools.cache
def plan_gate_up(rows: int, k: int, n: int) -> GemmPlan | None:
    """Tiles for gate_up_proj with SiLU-and-mul fused (n: the intermediate size), or None
    where cuBLAS and the activation kernel are faster (above 32 rows: the two products
    of a tile double its registers, and cuBLAS's larger tiles win)."""
    if rows > 32:
        return None
    if n >= 8192:
        plan = GemmPlan(bn=64, bm=_bm(rows), bk=128, splits=1, stages=3, warps=4)
    elif rows <= 16:
        plan = GemmPlan(bn=32, bm=16, bk=256, splits=1, stages=3, warps=4)
    else:
        plan = GemmPlan(bn=16, bm=32, bk=128, splits=1, stages=3, warps=4)
    return plan if _fits(plan, k, n) else None


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, plan: GemmPlan, gated: bool = False) -> torch.Tensor:
    """x @ weight.T as `plan` says: [splits, M, N] float32 partial sums when plan.splits > 1,
    else [M, N] in x's dtype; gated: weight is [2 N, K] (gate rows, then up rows) and the
    result silu(gate) * up."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
    assert _fits(plan, k, n) and not (gated and plan.splits > 1)
    if plan.splits > 1:
        out = torch.empty((plan.splits, m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (n // plan.bn, plan.splits, triton.cdiv(m, plan.bm))
    pdl = triton_pdl.enabled(x.device)
    _decode_gemm_kernel[grid](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(-2),
        BM=plan.bm, BN=plan.bn, BK=plan.bk, SPLIT_K=plan.splits, GATED=gated,
        DOT_F32=x.device.type == "cpu" or x.dtype == torch.float32, PDL=pdl,
        num_stages=plan.stages, num_warps=plan.warps, **triton_pdl.launch_options(pdl))
    return out


def gemm_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, plan: GemmPlan, residual: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm(x @ weight.T, residual) along `plan`: split-K partial sums go
    straight into the norm, which sums them. Returns (the normed sum, the sum)."""
    y = decode_gemm(x, weight, plan)
    if plan.splits == 1:
        return triton_fused.fused_add_rms_norm(y, residual, norm_weight, eps)
    return triton_fused.partials_add_rms_norm(y, residual, norm_weight, eps)
