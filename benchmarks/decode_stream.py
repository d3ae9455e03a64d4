"""Decode attention as one balanced key stream: a prototype against the engine's kernel.

The engine's decode attention runs one program per (sequence, kv head): ~2,000 programs of
very different lengths at 256 sequences, each starting its K/V pipeline from empty, and the
minimal kernel of decode_loads.py reads faster on long sequences (4.38 TB/s at U[100,2000])
than on the workload's shorter ones (4.19 at U[150,1074]). Here a fixed grid of P programs
(a few a SM) splits the step's whole key stream into P equal runs of key tiles: the
(sequence, kv head) pairs in a row, each pair's tiles in order. A program walks its run
in one loop, restarting the online softmax where a pair begins and writing where one ends:
the output itself when the pair lies inside the run, else a partial (output and log-sum-exp)
that a merge kernel combines with the other programs' parts of that pair. Every program
reads the same number of tiles, so nothing is left running alone at the end, and a
program's pipeline stays full across pair boundaries.

Three launches a step, all graph-capturable (sizes only from the device):
  tile map   tile t -> (sequence, kv head, tile of the pair, sequence length), pairs in
             launch order; once a step in an engine (the same for every layer), timed here
  stream     the P programs
  merge      one program per pair; pairs inside one run return at once

Shapes are decode_loads.py's (Qwen3-0.6B heads, 16-token blocks, bf16, one query token a
sequence). Prints each variant's time and read rate next to the engine's kernel and the
minimal kernel, and each one's error against the engine's output.

Usage: python benchmarks/decode_stream.py [--quick]
"""

from __future__ import annotations

import argparse
import random

import torch
import triton
import triton.language as tl

import decode_loads
from attention_kernels import bench_graph
from decode_loads import BLK, HD, KH, G, _softmax_step

D, H, BS, GROUP = decode_loads.D, decode_loads.H, decode_loads.BS, decode_loads.GROUP
MAP_FIELDS = 4  # sequence, kv head, tile of the pair, sequence length


@triton.jit
def tile_map(sl_ptr, order_ptr, map_ptr, start_ptr, total_ptr, n,
             BLOCK_N: tl.constexpr, NP: tl.constexpr, CHUNK: tl.constexpr):
    """Program i: the tiles of the i-th sequence in launch order, for every kv head.
    Its first tile is the key tiles of the sequences before it, times the kv heads."""
    i = tl.program_id(0)
    idx = tl.arange(0, NP)
    ok = idx < n
    lens = tl.load(sl_ptr + tl.load(order_ptr + idx, mask=ok, other=0), mask=ok, other=0)
    tiles = tl.where(ok, (lens + BLOCK_N - 1) // BLOCK_N, 0)
    before = tl.sum(tl.where(idx < i, tiles, 0), 0)
    if i == 0:
        tl.store(total_ptr, tl.sum(tiles, 0) * KH)
    b = tl.load(order_ptr + i)
    seq_len = tl.load(sl_ptr + b)
    n_t = (seq_len + BLOCK_N - 1) // BLOCK_N
    tl.store(start_ptr + i, before)
    base = before * KH
    c = tl.arange(0, CHUNK)
    for h in range(KH):
        for t0 in range(0, n_t, CHUNK):
            t = t0 + c
            row = (base + h * n_t + t) * 4
            m = t < n_t
            tl.store(map_ptr + row, b, mask=m)
            tl.store(map_ptr + row + 1, h, mask=m)
            tl.store(map_ptr + row + 2, t, mask=m)
            tl.store(map_ptr + row + 3, seq_len, mask=m)


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr):
    """Running max, normaliser and weighted sum of an online softmax over no keys yet."""
    return (tl.full([BLOCK_M], -1.0e30, dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
            tl.zeros([BLOCK_M, HD], dtype=tl.float32))


@triton.jit
def attn_stream(q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, bt_ptr, map_ptr, total_ptr,
                stride_bt, scale_log2, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    p = tl.program_id(0)
    total = tl.load(total_ptr)
    per = tl.cdiv(total, tl.num_programs(0))
    t0 = p * per
    t1 = tl.minimum(t0 + per, total)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HD)
    row_ok = rows < G
    m_i, l_i, acc = _empty_state(BLOCK_M)
    for t in range(t0, t1):
        b = tl.load(map_ptr + t * 4)
        kvh = tl.load(map_ptr + t * 4 + 1)
        tile = tl.load(map_ptr + t * 4 + 2)
        seq_len = tl.load(map_ptr + t * 4 + 3)
        # A pair's first tile (or the run's) starts a fresh softmax.
        fresh = (tile == 0) | (t == t0)
        m_i = tl.where(fresh, -1.0e30, m_i)
        l_i = tl.where(fresh, 0.0, l_i)
        acc = tl.where(fresh, 0.0, acc)
        q = tl.load(q_ptr + b * (KH * G * HD) + (kvh * G + rows)[:, None] * HD + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = j < seq_len
        phys = tl.load(bt_ptr + b * stride_bt + j // BLK, mask=ok, other=0).to(tl.int64)
        rowoff = phys[:, None] * (BLK * KH * HD) + (j % BLK)[:, None] * (KH * HD) + kvh * HD + d[None, :]
        k = tl.load(k_ptr + rowoff, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + rowoff, mask=ok[:, None], other=0.0)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, ok, scale_log2)
        # Where a pair's tiles end (or the run does): its output, or this run's part of it.
        pair_end = tile == (seq_len + BLOCK_N - 1) // BLOCK_N - 1
        flush = pair_end | (t == t1 - 1)
        started_here = t - tile >= t0
        o = acc / l_i[:, None]
        # Row masks (scalar conditions widened to the rows) for the two kinds of write.
        zero = tl.zeros([BLOCK_M], dtype=tl.int32)
        whole = row_ok & (zero + (flush & pair_end & started_here).to(tl.int32) != 0)
        part = row_ok & (zero + (flush & ~(pair_end & started_here)).to(tl.int32) != 0)
        tl.store(out_ptr + b * (KH * G * HD) + (kvh * G + rows)[:, None] * HD + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=whole[:, None])
        slot = (p * 2 + started_here.to(tl.int32)) * BLOCK_M + rows
        tl.store(part_o_ptr + slot[:, None] * HD + d[None, :], o, mask=part[:, None])
        tl.store(part_lse_ptr + slot, m_i + tl.log2(l_i), mask=part)


@triton.jit
def merge_parts(out_ptr, part_o_ptr, part_lse_ptr, sl_ptr, order_ptr, start_ptr, total_ptr, n_programs,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program (i, kvh): the pair's parts when its tiles were cut between runs. The run it
    starts in holds its part in slot 1 (started there), every later run in slot 0."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(order_ptr + i)
    n_t = (tl.load(sl_ptr + b) + BLOCK_N - 1) // BLOCK_N
    per = tl.cdiv(tl.load(total_ptr), n_programs)
    s = tl.load(start_ptr + i) * KH + kvh * n_t
    p_s = s // per
    p_e = (s + n_t - 1) // per
    if p_s == p_e:
        return
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HD)
    row_ok = rows < G
    m, w_sum, acc = _empty_state(BLOCK_M)
    for p in range(p_s, p_e + 1):
        slot = (p * 2 + (p == p_s).to(tl.int32)) * BLOCK_M + rows
        lse = tl.load(part_lse_ptr + slot, mask=row_ok, other=-1.0e30)
        o = tl.load(part_o_ptr + slot[:, None] * HD + d[None, :], mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        w_sum = w_sum * alpha + w
        acc = acc * alpha[:, None] + o * w[:, None]
        m = m_new
    res = acc / w_sum[:, None]
    tl.store(out_ptr + b * (KH * G * HD) + (kvh * G + rows)[:, None] * HD + d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def stream_variant(batch: dict, programs: int, block_n: int, warps: int, stages: int, max_len: int):
    """A launch closure (map, stream, merge) over `batch` and its output tensor."""
    q, k, v, table = batch["q"], batch["k"], batch["v"], batch["table"]
    n = q.shape[0]
    sl, order = batch["seq_lens"], batch["order"]
    max_tiles = n * triton.cdiv(max_len, block_n) * H
    tmap = torch.empty(max_tiles * MAP_FIELDS, dtype=torch.int32, device=q.device)
    start = torch.empty(n, dtype=torch.int32, device=q.device)
    total = torch.empty(1, dtype=torch.int32, device=q.device)
    part_o = torch.empty(programs * 2 * 16 * D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(programs * 2 * 16, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    scale_log2 = D ** -0.5 * 1.4426950408889634

    def launch():
        tile_map[(n,)](sl, order, tmap, start, total, n, BLOCK_N=block_n, NP=triton.next_power_of_2(n),
                       CHUNK=64, num_warps=1)
        attn_stream[(programs,)](q, k, v, out, part_o, part_lse, table, tmap, total, table.stride(0),
                                 scale_log2, BLOCK_N=block_n, BLOCK_M=16, num_warps=warps, num_stages=stages)
        merge_parts[(n, H)](out, part_o, part_lse, sl, order, start, total, programs,
                            BLOCK_N=block_n, BLOCK_M=16, num_warps=1)

    return launch, out


def main() -> None:
    from rlserve.ops import triton_attention as ta
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape, fewer variants")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rng = random.Random(0)
    shapes = [("256 x U[150,1074]", [rng.randint(100, 1024) + 50 for _ in range(256)]),
              ("256 x U[100,2000]", [rng.randint(100, 2000) for _ in range(256)]),
              ("128 x U[900,1900]", [rng.randint(900, 1900) for _ in range(128)]),
              ("64 x U[900,1900]", [rng.randint(900, 1900) for _ in range(64)]),
              ("32 x U[1000,2000]", [rng.randint(1000, 2000) for _ in range(32)])]
    tiles = [(32, 2, 3), (32, 2, 4), (64, 2, 3), (64, 4, 3), (64, 4, 4)]
    per_sm = [2, 3, 4]
    if args.quick:
        shapes, tiles, per_sm = shapes[:1], tiles[:2], [2, 4]
    for name, lens in shapes:
        batch = decode_loads.make_batch(lens)
        n = len(lens)
        qsl = torch.arange(n + 1, dtype=torch.int32, device="cuda")
        ref = torch.empty_like(batch["q"])
        eng = lambda: ta.paged_attention(  # noqa: E731
            batch["q"], batch["k"], batch["v"], qsl, batch["seq_lens"], batch["table"],
            D ** -0.5, max_query_len=1, max_seq_len=max(lens), out=ref, seq_order=batch["order"])
        eng()
        torch.cuda.synchronize()
        reference = ref.float().clone()
        us = bench_graph(eng)
        print(f"== {name}: engine {us:7.1f} us  {batch['kv_bytes'] / us / 1e3:5.0f} GB/s", flush=True)
        best = None
        for k in per_sm:
            for bn, w, s in tiles:
                fn, out = stream_variant(batch, k * sms, bn, w, s, max(lens))
                try:
                    fn()
                    torch.cuda.synchronize()
                except Exception as e:  # a tile that does not fit
                    print(f"  stream {k}/SM {(bn, w, s)}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                err = ((out.float() - reference).norm() / reference.norm()).item()
                t = bench_graph(fn)
                print(f"  stream {k}/SM tile {(bn, w, s)}: {t:7.1f} us  {batch['kv_bytes'] / t / 1e3:5.0f} GB/s"
                      f"  err {err:.4f}", flush=True)
                assert err < 2e-2, "the stream kernel disagrees with the engine's"
                if best is None or t < best[0]:
                    best = (t, k, (bn, w, s))
        if best:
            print(f"  best stream: {best[0]:.1f} us ({best[1]}/SM, tile {best[2]}), engine {us:.1f} us: "
                  f"{us / best[0] - 1:+.1%}", flush=True)
        del batch


if __name__ == "__main__":
    main()
