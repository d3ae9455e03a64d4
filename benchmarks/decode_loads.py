"""How close decode attention's cache reads come to what the GPU can read at all.

First the ceiling: a Triton kernel that only streams a large bf16 buffer (sums it), and
torch's own reduction over the same buffer. Then a minimal bf16 decode kernel (one query
token per sequence, Qwen3-0.6B's heads, 16-token blocks, longest sequence first) whose K/V
reads take different paths:

  pointers         gathered pointer loads through the block table (the engine's way)
  evict_first      the same with an L2 eviction hint (the cache is read once a step)
  .cg              the same, cached in L2 only
  tma              one tensor-memory-accelerator copy per 16-token block into shared memory
                   (a host-side descriptor over the cache viewed as [tokens, heads, dim])

Every variant runs a few tiles; the best is printed with its bandwidth and its error
against the pointer variant's output, and the engine's own kernel
(triton_attention.paged_attention with its chosen tile) runs on the same batches.

Usage: python benchmarks/decode_loads.py
"""

from __future__ import annotations

import random

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import attention_kernels
from attention_kernels import bench_graph

# kv heads, head_dim, block size, query heads per kv head: attention_kernels' batches
H, D, BS = attention_kernels.KV_HEADS, attention_kernels.HEAD_DIM, attention_kernels.BLOCK
GROUP = attention_kernels.HEADS // H
KH, HD, BLK, G = (tl.constexpr(c) for c in (H, D, BS, GROUP))  # the same, for the kernels


@triton.jit
def stream_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, EVICT: tl.constexpr = ""):
    """Each program sums ITERS consecutive BLOCKs of x: a pure read stream (EVICT: the
    loads' L2 eviction policy, as tl.load takes it)."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy=EVICT).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _softmax_step(acc, l_i, m_i, q, k, v, ok, scale_log2):
    qk = tl.dot(q, tl.trans(k)) * scale_log2
    qk = tl.where(ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _start(q_ptr, sl_ptr, order_ptr, BLOCK_M: tl.constexpr):
    """A program's kv head, sequence, length and query rows (G heads padded to BLOCK_M)."""
    kvh = tl.program_id(0)
    b = tl.load(order_ptr + tl.program_id(1))
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + b * (KH * G * HD) + (kvh * G + rows)[:, None] * HD + d[None, :],
                mask=(rows < G)[:, None], other=0.0)
    return kvh, b, tl.load(sl_ptr + b), q


@triton.jit
def _finish(out_ptr, acc, l_i, kvh, b, BLOCK_M: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HD)
    o = acc / l_i[:, None]
    tl.store(out_ptr + b * (KH * G * HD) + (kvh * G + rows)[:, None] * HD + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(rows < G)[:, None])


@triton.jit
def attn_pointers(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, sl_ptr, order_ptr, stride_bt, scale_log2,
                  EVICT: tl.constexpr, CACHE: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    kvh, b, seq_len, q = _start(q_ptr, sl_ptr, order_ptr, BLOCK_M)
    d = tl.arange(0, HD)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HD], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        ok = j < seq_len
        phys = tl.load(bt_ptr + b * stride_bt + j // BLK, mask=ok, other=0).to(tl.int64)
        rowoff = phys[:, None] * (BLK * KH * HD) + (j % BLK)[:, None] * (KH * HD) + kvh * HD + d[None, :]
        k = tl.load(k_ptr + rowoff, mask=ok[:, None], other=0.0, eviction_policy=EVICT, cache_modifier=CACHE)
        v = tl.load(v_ptr + rowoff, mask=ok[:, None], other=0.0, eviction_policy=EVICT, cache_modifier=CACHE)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, ok, scale_log2)
    _finish(out_ptr, acc, l_i, kvh, b, BLOCK_M)


@triton.jit
def attn_tma(q_ptr, k_desc, v_desc, out_ptr, bt_ptr, sl_ptr, order_ptr, stride_bt, scale_log2,
             BLOCK_M: tl.constexpr):
    """One 16-token block a step: its K and V rows of this kv head arrive by TMA."""
    kvh, b, seq_len, q = _start(q_ptr, sl_ptr, order_ptr, BLOCK_M)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HD], dtype=tl.float32)
    for i in range(0, tl.cdiv(seq_len, BLK)):
        phys = tl.load(bt_ptr + b * stride_bt + i)
        k = k_desc.load([phys * BLK, kvh, 0]).reshape(BLK, HD)
        v = v_desc.load([phys * BLK, kvh, 0]).reshape(BLK, HD)
        ok = i * BLK + tl.arange(0, BLK) < seq_len
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, ok, scale_log2)
    _finish(out_ptr, acc, l_i, kvh, b, BLOCK_M)


def make_batch(lens: list[int]) -> dict:
    """One query token per sequence over a shuffled bf16 cache (attention_kernels' batch),
    longest sequence first."""
    batch = attention_kernels.make_batch([n - 1 for n in lens], [1] * len(lens))
    seq_lens = batch["seq_lens"]
    return dict(q=batch["query"], k=batch["k_cache"], v=batch["v_cache"],
                table=batch["block_tables"], seq_lens=seq_lens, kv_bytes=batch["kv_bytes"],
                order=torch.argsort(seq_lens, descending=True).to(torch.int32))


def variants(batch: dict):
    """(label, tile, launch closure, output) for every variant and tile."""
    q, k, v, table = batch["q"], batch["k"], batch["v"], batch["table"]
    scale_log2 = D ** -0.5 * 1.4426950408889634
    common = (table, batch["seq_lens"], batch["order"], table.stride(0), scale_log2)
    grid = (H, q.shape[0])
    for label, evict, cache in (("pointers", "", ""), ("evict_first", "evict_first", ""), (".cg", "", ".cg")):
        for block_n, warps, stages in [(32, 2, 3), (64, 2, 3), (64, 4, 3), (128, 4, 3)]:
            out = torch.empty_like(q)
            yield label, (block_n, warps, stages), (
                lambda out=out, bn=block_n, w=warps, s=stages, e=evict, c=cache: attn_pointers[grid](
                    q, k, v, out, *common, EVICT=e, CACHE=c, BLOCK_N=bn, BLOCK_M=16,
                    num_warps=w, num_stages=s)), out
    shape3 = [k.shape[0] * BS, H, D]
    k_desc = TensorDescriptor(k, shape3, [H * D, D, 1], [BS, 1, D])
    v_desc = TensorDescriptor(v, shape3, [H * D, D, 1], [BS, 1, D])
    for warps, stages in [(1, 4), (2, 4), (2, 6), (4, 4), (4, 8)]:
        out = torch.empty_like(q)
        yield "tma", (BS, warps, stages), (
            lambda out=out, w=warps, s=stages: attn_tma[grid](
                q, k_desc, v_desc, out, *common, BLOCK_M=16, num_warps=w, num_stages=s)), out


def ceiling() -> None:
    n = 2 ** 30  # 2 GiB of bf16, far past the L2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for block, iters, warps in [(2048, 16, 4), (4096, 8, 8), (1024, 64, 4), (8192, 8, 8)]:
        out = torch.empty(triton.cdiv(n, block * iters), device="cuda")
        us = bench_graph(lambda: stream_sum[(out.numel(),)](x, out, n, BLOCK=block, ITERS=iters,
                                                             num_warps=warps))
        print(f"  stream_sum BLOCK {block} x {iters}, {warps} warps: {us:7.1f} us  "
              f"{2 * n / us / 1e3:5.0f} GB/s", flush=True)
    us = bench_graph(lambda: x.sum(dtype=torch.float32))
    print(f"  torch sum: {us:7.1f} us  {2 * n / us / 1e3:5.0f} GB/s", flush=True)


def main() -> None:
    from rlserve.ops import triton_attention as ta
    print("== read ceiling (2 GiB bf16)", flush=True)
    ceiling()
    rng = random.Random(0)
    shapes = [("256 x U[150,1074]", [rng.randint(100, 1024) + 50 for _ in range(256)]),
              ("256 x U[100,2000]", [rng.randint(100, 2000) for _ in range(256)]),
              ("128 x U[900,1900]", [rng.randint(900, 1900) for _ in range(128)])]
    for name, lens in shapes:
        batch = make_batch(lens)
        print(f"== {name}", flush=True)
        best, reference = {}, None
        for label, tile, fn, out in variants(batch):
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:  # a tile that does not fit, or a path this GPU lacks
                print(f"  {label} {tile}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            if reference is None:
                reference = out.float().clone()
            err = ((out.float() - reference).norm() / reference.norm()).item()
            us = bench_graph(fn)
            print(f"    {label:12s} {tile}: {us:7.1f} us  err {err:.4f}", flush=True)
            if label not in best or us < best[label][0]:
                best[label] = (us, tile, err)
        # The engine's kernel and tile on the same batch.
        n = len(lens)
        qsl = torch.arange(n + 1, dtype=torch.int32, device="cuda")
        eng_out = torch.empty_like(batch["q"])
        eng = lambda: ta.paged_attention(  # noqa: E731
            batch["q"], batch["k"], batch["v"], qsl, batch["seq_lens"], batch["table"],
            D ** -0.5, max_query_len=1, max_seq_len=max(lens), out=eng_out,
            seq_order=batch["order"])
        eng()
        err = ((eng_out.float() - reference).norm() / reference.norm()).item()
        own = ta._pick_config(1, GROUP, D, n, BS, 2)
        best["engine"] = (bench_graph(eng), (own["BLOCK_N"], own["num_warps"], own["num_stages"]), err)
        for label, (us, tile, err) in best.items():
            print(f"  {label:12s} {us:7.1f} us  {batch['kv_bytes'] / us / 1e3:5.0f} GB/s  "
                  f"tile {tile}  err {err:.4f}", flush=True)
        assert all(e < 2e-2 for _, _, e in best.values()), "a variant disagrees"
        del batch


if __name__ == "__main__":
    main()
