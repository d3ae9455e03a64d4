"""Triton kernels for batched LoRA (see lora.py for the layout): a shrink kernel
u[t, s] = x[t] A[slot, s]^T, then an expand kernel y[t, slice s] += u[t, s] B[slot, slice s]^T,
for the tokens of every adapter slot in one launch each.

Each program takes BLOCK_M tokens of one slot (rows of `sorted_tokens` between that slot's
`slot_starts`), so an adapter's A and B tiles are read once per BLOCK_M tokens and the
products run on tensor cores. The grid covers every slot and the whole batch whatever
the batch holds, and programs past their slot's tokens return at once: the launch shape
depends only on the token count, so the kernels replay inside CUDA graphs. Tokens of
the base model (in no slot) are never read or written. u is float32, and both products
accumulate in float32.

The shrink's reduction over `in` is split across SPLIT_K programs: a decode step has few
tokens per adapter, and one program walking all of `in` left most of the GPU idle. Each
split writes its own partial u; the expand sums the partials in a fixed order, so the
result does not depend on which program finished first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, u_ptr, sorted_ptr, starts_ptr,
    K, R,
    stride_xm, stride_al, stride_as, stride_ar, stride_uk, stride_um, stride_us,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    s = tl.program_id(1) // SPLIT_K
    split = tl.program_id(1) % SPLIT_K
    slot = tl.program_id(2)
    start = tl.load(starts_ptr + slot)
    end = tl.load(starts_ptr + slot + 1)
    m0 = start + pid_m * BLOCK_M
    if m0 >= end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot.to(tl.int64) * stride_al + s * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):  # this split's tiles of `in`
        kk = k0 + offs_k
        mask_k = kk < K
        xt = tl.load(x_ptr + tok[:, None] * stride_xm + kk[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_base + offs_r[None, :] * stride_ar + kk[:, None],  # [BLOCK_K, BLOCK_R]: A^T
                     mask=mask_r[None, :] & mask_k[:, None], other=0.0)
        acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision=PRECISION)
    tl.store(u_ptr + split * stride_uk + tok[:, None] * stride_um + s * stride_us + offs_r[None, :], acc,
             mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(
    u_ptr, b_ptr, y_ptr, sorted_ptr, starts_ptr, slice_offsets_ptr, slice_sizes_ptr,
    R, NUM_SLICES,
    stride_uk, stride_um, stride_us, stride_bl, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2) % NUM_SLICES
    slot = tl.program_id(2) // NUM_SLICES
    start = tl.load(starts_ptr + slot)
    end = tl.load(starts_ptr + slot + 1)
    m0 = start + pid_m * BLOCK_M
    size = tl.load(slice_sizes_ptr + s)
    n0 = pid_n * BLOCK_N
    if m0 >= end or n0 >= size:
        return
    offset = tl.load(slice_offsets_ptr + s)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < size
    u_ptrs = u_ptr + tok[:, None] * stride_um + s * stride_us + offs_r[None, :]
    mask_u = mask_m[:, None] & mask_r[None, :]
    ut = tl.load(u_ptrs, mask=mask_u, other=0.0)
    for split in tl.static_range(1, SPLIT_K):  # the shrink's partials, always in this order
        ut += tl.load(u_ptrs + split * stride_uk, mask=mask_u, other=0.0)
    cols = offset + offs_n
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + cols[None, :] * stride_bn + offs_r[:, None],
                 mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]: B^T
    delta = tl.dot(ut, bt.to(tl.float32), input_precision=PRECISION)
    y_ptrs = y_ptr + tok[:, None] * stride_ym + cols[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


# Launch shapes; `lora_shrink_expand(config=...)` overrides them (benchmarks/lora_kernels.py).
DEFAULT_CONFIG = dict(BLOCK_M=16, BLOCK_K=128, BLOCK_N=128, MAX_SPLIT_K=4,
                      shrink_warps=4, shrink_stages=3, expand_warps=4, expand_stages=3)


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       slices: list[tuple[int, int]], slice_table: torch.Tensor,
                       sorted_tokens: torch.Tensor, slot_starts: torch.Tensor,
                       config: dict | None = None) -> None:
    """y [T, out] += each token's adapter delta, in place. x [T, in] (last dim contiguous),
    a [L, S, R, in], b [L, out, R] (contiguous), `slices` and `slice_table` (the same
    (offset, size) pairs as a [2, S] int32 device tensor), sorted_tokens [>= T] int32 and
    slot_starts [L + 1] int32 as in lora.LoRABatch."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    cfg = DEFAULT_CONFIG if config is None else {**DEFAULT_CONFIG, **config}
    num_slots, num_slices, rank, k = a.shape
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
    assert len(slices) == num_slices and b.shape[0] == num_slots and b.shape[2] == rank
    block_m, block_k, block_n = cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["BLOCK_N"]
    block_r = max(16, triton.next_power_of_2(rank))
    split_k = max(1, min(triton.cdiv(k, block_k), cfg["MAX_SPLIT_K"]))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    u = torch.empty((split_k, num_tokens, num_slices, rank), dtype=torch.float32, device=x.device)
    m_tiles = triton.cdiv(num_tokens, block_m)
    _shrink_kernel[(m_tiles, num_slices * split_k, num_slots)](
        x, a, u, sorted_tokens, slot_starts, k, rank,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), u.stride(0), u.stride(1), u.stride(2),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k, PRECISION=precision,
        num_warps=cfg["shrink_warps"], num_stages=cfg["shrink_stages"])
    max_size = max(n for _, n in slices)
    _expand_kernel[(m_tiles, triton.cdiv(max_size, block_n), num_slices * num_slots)](
        u, b, y, sorted_tokens, slot_starts, slice_table[0], slice_table[1], rank, num_slices,
        u.stride(0), u.stride(1), u.stride(2), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, SPLIT_K=split_k, PRECISION=precision,
        num_warps=cfg["expand_warps"], num_stages=cfg["expand_stages"])
