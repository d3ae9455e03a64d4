"""Decode GEMMs of Qwen3-0.6B: cuBLAS against a Triton GEMM written for few rows.

The Triton kernel computes W @ X^T (the weight rows fill the MMA's M side, so a batch of
16 to 256 tokens is its narrow N side), optionally splitting K across programs; with
splits, the partial sums are either reduced by a second kernel or left in float32, the
cost a consumer that reduces them (the next RMSNorm, say) would save. Each variant is
checked against torch, then timed as a CUDA-graph replay of 28 GEMMs with distinct
weights (one per layer, so none is served from L2).

Usage: python benchmarks/decode_gemm.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from attention_kernels import bench_graph

LAYERS = 28
SHAPES = [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024)]  # (K, N)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)  # the row tiles of one weight tile are neighbours
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    k_per = K // SPLIT_K
    rk = pid_k * k_per + tl.arange(0, BK)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    m_ok = rm < M
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for _ in range(0, k_per, BK):
        acc = tl.dot(tl.load(w_ptrs), tl.trans(tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)), acc)
        w_ptrs += BK
        x_ptrs += BK
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
    else:
        tl.store(part_ptr + (pid_k * M + rm[None, :]).to(tl.int64) * N + rn[:, None], acc,
                 mask=m_ok[None, :])


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, M, N, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.load(part_ptr + row * N + cols, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def gemm(x, w, out, part, BM, BN, BK, SPLIT_K, stages, reduce=True):
    M, K = x.shape
    N = w.shape[0]
    _gemm_kernel[(triton.cdiv(M, BM), N // BN, SPLIT_K)](
        x, w, out, part, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BM=BM, BN=BN, BK=BK, SPLIT_K=SPLIT_K, num_stages=stages, num_warps=4)
    if SPLIT_K > 1 and reduce:
        _reduce_kernel[(M, triton.cdiv(N, 1024))](part, out, M, N, SPLIT_K=SPLIT_K, BLOCK=1024, num_warps=4)


def main() -> None:
    dtype = torch.bfloat16
    for name, k, n in SHAPES:
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.03 for _ in range(LAYERS)]
        for m in (256, 128, 64, 16):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            out = torch.empty(m, n, device="cuda", dtype=dtype)
            part = torch.empty(4, m, n, device="cuda", dtype=torch.float32)
            expected = torch.nn.functional.linear(x, weights[0]).float()
            cublas = bench_graph(lambda: [torch.nn.functional.linear(x, w) for w in weights], iters=30) / LAYERS
            rows = []
            p2 = triton.next_power_of_2(m)
            tiles_m = sorted({max(16, min(p2, 32)), min(p2, 64), min(p2, 128), min(p2, 256)})
            for bm, bn, bk, split, stages in itertools.product(tiles_m, (64, 128), (128, 256), (1, 2, 4), (3, 4)):
                if k % (split * bk) or (bm + bn) * bk * 2 * stages > 200_000:
                    continue
                kw = dict(BM=bm, BN=bn, BK=bk, SPLIT_K=split, stages=stages)
                try:
                    gemm(x, weights[0], out, part, **kw)
                    err = ((out.float() - expected).norm() / expected.norm()).item()
                    assert err < 1e-2, err
                    t = bench_graph(lambda: [gemm(x, w, out, part, **kw) for w in weights], iters=30) / LAYERS
                    t_partial = (bench_graph(lambda: [gemm(x, w, out, part, reduce=False, **kw) for w in weights],
                                             iters=30) / LAYERS if split > 1 else t)
                except Exception as e:  # out of resources
                    print(f"  {name} M={m} {kw}: failed ({type(e).__name__})", flush=True)
                    continue
                rows.append((t, t_partial, kw))
            best = min(rows, key=lambda r: r[0])
            best_partial = min(rows, key=lambda r: r[1])
            print(f"{name} K={k} N={n} M={m}: cuBLAS {cublas:.2f} us | Triton {best[0]:.2f} us {best[2]} | "
                  f"partial sums left unreduced {best_partial[1]:.2f} us {best_partial[2]}", flush=True)
        del weights


if __name__ == "__main__":
    main()
