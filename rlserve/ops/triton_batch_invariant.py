"""Batch-invariant Triton kernels: the GEMM and the row mean of ops/batch_invariant.py on CUDA.

- matmul: one [BLOCK_M, BLOCK_N] output tile per program, K walked in BLOCK_K steps in order,
  no split-K. The tile shape is chosen from (N, K) only, never from M, so every output
  element is the same sequence of fp32 MMA accumulations whatever the number of rows and
  wherever its row sits: one launch instead of the torch fallback's one GEMM per 16 rows.
- row_mean: one program per row, the row walked in BLOCK steps in order into a lane-wise
  fp32 accumulator, reduced once at the end: its order depends on the row length alone.
- attention: one sequence's causal attention through the paged kernel of
  ops/triton_attention.py in its batch-invariant mode, over keys laid out as a cache of
  BLOCK_SIZE-token blocks: the bits the server's queries get at the same positions.

Importing this module imports triton; ops/batch_invariant.py imports it lazily, on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def tile_shape(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for an [M, k] x [k, n] GEMM: from n and k only."""
    return 64, (128 if n >= 4096 else 64), (64 if k >= 64 else 32)


# Faster launch shapes by row count: (rows up to, BLOCK_M, BLOCK_N, warps, stages), the last
# for any count. BLOCK_K, and so each output's order of K steps, stays tile_shape's. Whether
# another row or column tile also keeps each output's bits is the card's MMA instructions'
# business (benchmarks/invariant_tiles.py measures it), so these shapes run only once
# check_tiles() has found, on this card, the bits of tile_shape's for every one of them.
TILES: tuple[tuple[int, int, int, int, int], ...] = ()
_tiles_checked: set[int] = set()  # the CUDA devices where TILES passed check_tiles


def _launch(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype) -> tuple[int, int, int, dict]:
    bm, bn, bk = tile_shape(n, k)
    if TILES and dtype != torch.float32 and device.index in _tiles_checked:
        _, bm, bn, warps, stages = next((t for t in TILES if m <= t[0]), TILES[-1])
        return bm, bn, bk, dict(num_warps=warps, num_stages=stages)
    return bm, bn, bk, {}


def check_tiles(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether every shape of TILES gives tile_shape's bits here (random rows, several
    projection shapes and row counts); enables them on `device` if so."""
    gen = torch.Generator(device=device).manual_seed(0)
    for n, k in ((1024, 1024), (4096, 1024), (1024, 3072), (3000, 576)):
        x = torch.randn(300, k, device=device, generator=gen).to(dtype)
        w = (torch.randn(n, k, device=device, generator=gen) / k ** 0.5).to(dtype)
        want = linear(x, w)
        for _, bm, bn, warps, stages in TILES:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, warps=warps, stages=stages)
            if not all(torch.equal(linear(x[:m], w, _config=cfg), want[:m]) for m in (1, 37, 300)):
                return False
    _tiles_checked.add(device.index if device.index is not None else torch.cuda.current_device())
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           _config: dict | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) in x's dtype, fp32 accumulation. `_config`
    (BLOCK_M, BLOCK_N, warps, stages) only from benchmarks/invariant_tiles.py."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    weight = weight.contiguous()
    m, n = rows.shape[0], weight.shape[0]
    out = rows.new_empty((m, n))
    if m:
        bm, bn, bk, launch = _launch(m, n, k, x.device, x.dtype)
        if _config:
            bm, bn = _config["BLOCK_M"], _config["BLOCK_N"]
            launch = dict(num_warps=_config["warps"], num_stages=_config["stages"])
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _matmul_kernel[grid](rows, weight, bias if bias is not None else weight, out, m, n, k,
                             rows.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **launch)
    return out.reshape(*lead, n)


def _row_block(n: int) -> int:
    """The lanes a row's sum is spread over: the row mean's and the one-launch RMSNorm's
    (their bits agree only while both sum in the same lanes)."""
    return min(triton.next_power_of_2(n), 1024)


@triton.jit
def _row_mean_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        acc += tl.load(x_ptr + row * stride + c0 + cols, mask=c0 + cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, 0) / n_cols)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> [..., 1] float32: the mean of each row."""
    n = x.shape[-1]
    rows = x.reshape(-1, n).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _row_mean_kernel[(rows.shape[0],)](rows, out, n, rows.stride(0),
                                          BLOCK=_row_block(n))
    return out.view(*x.shape[:-1], 1)


@triton.jit
def _norm_input(x_row, res_row, c, n_cols, HAS_RESIDUAL: tl.constexpr):
    """A chunk of the row the norm reads: x, or x + residual rounded to the activation dtype
    (as torch adds them)."""
    x = tl.load(x_row + c, mask=c < n_cols, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_row + c, mask=c < n_cols, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, heads, stride_xt, stride_xh,
                     stride_r, stride_ot, stride_oh, stride_ro, eps, HAS_RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr, VEC: tl.constexpr, LIBDEVICE: tl.constexpr):
    """ops/batch_invariant.rms_norm in one launch: the squares summed lane-wise in BLOCK
    steps and reduced once, as _row_mean_kernel sums the float32 squares it is given; VEC
    the loads' vector width, so the lanes hold the elements the float32 kernel's lanes hold.
    Row r is token r // heads, head r % heads (a [T, H, D] view of per-head norms); a row is
    read in full before it is written, so out may be x."""
    row = tl.program_id(0).to(tl.int64)
    t, h = row // heads, row % heads
    x_row = x_ptr + t * stride_xt + h * stride_xh
    out_row = out_ptr + t * stride_ot + h * stride_oh
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), VEC), VEC)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        v = _norm_input(x_row, res_ptr + row * stride_r, c0 + cols, n_cols, HAS_RESIDUAL).to(tl.float32)
        acc += v * v
    mean = tl.sum(acc, 0) / n_cols
    if LIBDEVICE:  # CUDA's rsqrtf, which torch.rsqrt calls (the interpreter has no libdevice)
        inv = libdevice.rsqrt(mean + eps)
    else:
        inv = tl.rsqrt(mean + eps)
    for c0 in range(0, n_cols, BLOCK):
        c = c0 + cols
        x = _norm_input(x_row, res_ptr + row * stride_r, c, n_cols, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + row * stride_ro + c, x, mask=c < n_cols)
        y = (x.to(tl.float32) * inv).to(x.dtype)
        w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0)
        y = w.to(tl.float32) * y.to(tl.float32)
        tl.store(out_row + c, y.to(out_ptr.dtype.element_ty), mask=c < n_cols)


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(heads, token stride, head stride) of a [R, D] or [T, H, D] tensor."""
    return (1, t.stride(0), 0) if t.dim() == 2 else (t.shape[1], t.stride(0), t.stride(1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, vec: int = 4,
             libdevice_rsqrt: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual), x + residual) in one launch; residual None: (rms_norm(x), None).
    x [R, D] or [T, H, D] (a per-head norm's strided view), unit stride in D; `out` (x's
    shape; x itself normalises in place) or a new tensor. residual: x 2-D, contiguous rows."""
    n = x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        x = x.reshape(-1, n).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == x.shape and out.stride(-1) == 1
    res_out = None
    if residual is not None:
        assert x.dim() == 2 and residual.shape == x.shape and residual.stride(-1) == 1
        res_out = torch.empty_like(x)
    heads, sxt, sxh = _row_strides(x)
    _, sot, soh = _row_strides(out)
    rows = x.shape[0] * heads
    if rows:
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out,
            n, heads, sxt, sxh, residual.stride(0) if residual is not None else 0, sot, soh,
            res_out.stride(0) if res_out is not None else 0, eps, HAS_RESIDUAL=residual is not None,
            BLOCK=_row_block(n), VEC=vec,
            LIBDEVICE=libdevice_rsqrt and x.is_cuda, enable_fp_fusion=False)
    return out, res_out


# The engine's default KV block size: the trainer's keys take the server's kernel variant.
BLOCK_SIZE = 16


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float) -> torch.Tensor:
    """Queries q [M, H, D] at positions q_start .. q_start + M - 1 attend causally to keys
    and values k, v [L, Hkv, D] (L >= q_start + M; keys past the last query are unseen).
    Returns [M, H, D] in q's dtype."""
    from rlserve.ops import triton_attention
    m = q.shape[0]
    length = q_start + m
    if k.shape[0] < length or v.shape[0] < length:
        raise ValueError(f"attention: {k.shape[0]} keys, queries reach position {length - 1}")
    blocks = -(-length // BLOCK_SIZE)

    def paged(x: torch.Tensor) -> torch.Tensor:
        cache = x.new_zeros((blocks * BLOCK_SIZE, *x.shape[1:]))
        cache[:length] = x[:length]
        return cache.view(blocks, BLOCK_SIZE, *x.shape[1:])

    table = torch.arange(blocks, dtype=torch.int32, device=q.device)[None]
    qsl = torch.tensor([0, m], dtype=torch.int32, device=q.device)
    seq_lens = torch.tensor([length], dtype=torch.int32, device=q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    return triton_attention.paged_attention(q, paged(k), paged(v), qsl, seq_lens, table, scale,
                                            max_query_len=m, max_seq_len=length, batch_invariant=True)
