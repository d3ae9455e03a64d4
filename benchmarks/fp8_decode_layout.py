"""Where fp8 decode attention spends its time: a minimal decode kernel (one query token per
sequence, GQA group 2, Qwen3-0.6B's heads) over a bf16 cache and over fp8 caches, with and
without per-row scales, values stored token-major (the engine's layout) or transposed per
block ([block, head, dim, token]), computing in bfloat16 or float16, values widened by
Triton's cast or by the conversion instruction the engine uses (triton_attention.
widen_values). Every variant runs a few tiles; the best is printed with its error against
the bf16 variant's output.

Usage: python benchmarks/fp8_decode_layout.py
"""

from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from attention_kernels import bench_graph
from rlserve.ops.triton_attention import widen_values


@triton.jit
def attn(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, bt_ptr, sl_ptr, stride_bt, scale_log2,
         FP8: tl.constexpr, VT: tl.constexpr, SCALES: tl.constexpr, F16: tl.constexpr,
         H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
         GROUP: tl.constexpr, BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    """One program per (kv head, sequence): no masking beyond the sequence's end, no splits."""
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(sl_ptr + b)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * (H * GROUP * D) + (kvh * GROUP + rows)[:, None] * D + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if F16:
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        ok = j < seq_len
        phys = tl.load(bt_ptr + b * stride_bt + j // BS, mask=ok, other=0).to(tl.int64)
        off = j % BS
        k = tl.load(k_ptr + phys[:, None] * (BS * H * D) + off[:, None] * (H * D) + kvh * D + d[None, :],
                    mask=ok[:, None], other=0.0)
        if FP8:
            k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k))
        if SCALES:
            sc = phys * (BS * H) + off * H + kvh
            ks = tl.load(ks_ptr + sc, mask=ok, other=0.0)
            vs = tl.load(vs_ptr + sc, mask=ok, other=0.0)
            qk = qk * (ks * scale_log2)[None, :]
        else:
            qk = qk * scale_log2
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if VT == 2:
            # Whole blocks: [blocks, dim, token] with the in-block token offset its own
            # axis, so each dim's BS bytes are one vector load; then [dim, keys].
            blk = start // BS + tl.arange(0, BLOCK_N // BS)
            t = tl.arange(0, BS)
            b_ok = blk * BS < seq_len
            pb = tl.load(bt_ptr + b * stride_bt + blk, mask=b_ok, other=0).to(tl.int64)
            # Masked by whole blocks (a per-token mask would split the vector loads); the
            # last block's unused slots are zeroed after the load, so no stale byte
            # (NaN in e4m3 too) meets the dot.
            vt3 = tl.load(v_ptr + pb[:, None, None] * (H * D * BS) + kvh * (D * BS)
                          + d[None, :, None] * BS + t[None, None, :], mask=b_ok[:, None, None],
                          other=0.0)
            vt3 = tl.where((blk[:, None, None] * BS + t[None, None, :]) < seq_len, vt3, 0.0)
            v = tl.trans(tl.reshape(tl.permute(vt3, (1, 0, 2)), (D, BLOCK_N)))
        elif VT:
            vt = tl.load(v_ptr + phys[None, :] * (H * D * BS) + kvh * (D * BS) + d[:, None] * BS + off[None, :],
                         mask=ok[None, :], other=0.0)
            v = tl.trans(vt)
        else:
            v = tl.load(v_ptr + phys[:, None] * (BS * H * D) + off[:, None] * (H * D) + kvh * D + d[None, :],
                        mask=ok[:, None], other=0.0)
        if FP8:
            v = widen_values(v, q.dtype, ASM)
        if SCALES:
            p = p * vs[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out_ptr + b * (H * GROUP * D) + (kvh * GROUP + rows)[:, None] * D + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


H, D, BS, GROUP = 8, 128, 16, 2  # kv heads, head_dim, block size, query heads per kv head
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# name: (fp8 cache, values transposed per block (2: and read a whole block a load), per-row
# scales, float16 dots, fp8 type, values widened by the conversion instruction)
VARIANTS = {"bf16": (0, 0, 0, 0, None, 0), "e4m3": (1, 0, 0, 0, E4, 0),
            "e4m3+scales": (1, 0, 1, 0, E4, 0), "e4m3 Vt": (1, 1, 0, 0, E4, 0),
            "e4m3 Vt+scales": (1, 1, 1, 0, E4, 0), "e5m2": (1, 0, 0, 0, E5, 0),
            "e4m3 f16": (1, 0, 0, 1, E4, 0), "e4m3 Vt f16+scales": (1, 1, 1, 1, E4, 0),
            "e5m2 Vt f16": (1, 1, 0, 1, E5, 0), "e4m3 f16+scales": (1, 0, 1, 1, E4, 0),
            "e4m3 f16+scales, asm": (1, 0, 1, 1, E4, 1), "e5m2 f16+scales, asm": (1, 0, 1, 1, E5, 1),
            "e4m3 Vt blocks f16+scales": (1, 2, 1, 1, E4, 0)}
TILES = [(32, 2, 3), (64, 2, 2), (64, 2, 3), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3)]


def make_batch(lens: list[int], seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [(s + BS - 1) // BS for s in lens]
    num_blocks = sum(nblk) + 8
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device="cuda")
    i = 0
    for r, n in enumerate(nblk):
        table[r, :n] = perm[i:i + n]
        i += n
    k = torch.randn(num_blocks, BS, H, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(num_blocks, BS, H, D, device="cuda", generator=gen).bfloat16()
    q = torch.randn(len(lens), H * GROUP, D, device="cuda", generator=gen).bfloat16()
    return dict(q=q, k=k, v=v, table=table, tokens=sum(lens),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"))


def launcher(batch: dict, variant: tuple, tile: tuple):
    """The variant's kernel launch as a closure, and its output tensor (run once)."""
    fp8, vt, scales, f16, fp8_type, asm = variant
    q, k, v = batch["q"], batch["k"], batch["v"]
    if fp8:
        k, v = k.float().to(fp8_type), v.float().to(fp8_type)
    if vt:
        v = v.permute(0, 2, 3, 1).contiguous()  # [block, head, dim, token]
    ks = torch.ones(batch["k"].shape[:3], device="cuda")
    vs = torch.ones_like(ks)
    out = torch.empty_like(q)
    block_n, warps, stages = tile
    table = batch["table"]

    def fn():
        attn[(H, q.shape[0])](q, k, v, ks, vs, out, table, batch["seq_lens"], table.stride(0),
                              D ** -0.5 * 1.4426950408889634, FP8=fp8, VT=vt, SCALES=scales,
                              F16=f16, H=H, D=D, BS=BS, BLOCK_N=block_n, GROUP=GROUP, BLOCK_M=16, ASM=asm,
                              num_warps=warps, num_stages=stages)
    fn()
    torch.cuda.synchronize()
    return fn, out


def main() -> None:
    rng = random.Random(0)
    shapes = [("256 x U[150,1074] longest first",
               sorted((rng.randint(100, 1024) + 50 for _ in range(256)), reverse=True)),
              ("256 x U[100,2000] longest first",
               sorted((rng.randint(100, 2000) for _ in range(256)), reverse=True)),
              ("128 x U[900,1900]", sorted((rng.randint(900, 1900) for _ in range(128)), reverse=True))]
    for name, lens in shapes:
        batch = make_batch(lens)
        reference = None  # the bf16 variant's output, the first one run
        print(f"== {name}", flush=True)
        for label, variant in VARIANTS.items():
            best = None
            for tile in TILES:
                try:
                    fn, out = launcher(batch, variant, tile)
                except Exception as e:  # a tile that does not fit
                    print(f"  {label} {tile}: {type(e).__name__}", flush=True)
                    continue
                if reference is None:
                    reference = out.float().clone()
                err = ((out.float() - reference).norm() / reference.norm()).item()
                us = bench_graph(fn)
                if best is None or us < best[0]:
                    best = (us, tile, err)
            if best:
                row_bytes = D * (1 if variant[0] else 2) + (4 if variant[2] else 0)
                gbps = batch["tokens"] * H * row_bytes * 2 / best[0] / 1e3
                print(f"  {label:20s} {best[0]:7.1f} us  {gbps:5.0f} GB/s  tile {best[1]}  "
                      f"err {best[2]:.3f}", flush=True)


if __name__ == "__main__":
    main()
