"""Sweeps the decode paged-attention launch: tile config x program order x KV splits.

Shapes are Qwen3-0.6B's (16 query heads, 8 kv heads, head_dim 128, bf16, block size 16), on
context mixes like those of the throughput workload's decode steps. Each variant is checked
against the torch reference, then timed as a CUDA-graph replay.

Usage: python benchmarks/decode_sweep.py [--json PATH]
       python benchmarks/decode_sweep.py --tail   # the end of a run: fewer, longer sequences,
                                                  # longest first, more KV splits
       python benchmarks/decode_sweep.py --kv-cache-dtype fp8  # tiles for an fp8 cache
       python benchmarks/decode_sweep.py --cache  # block sizes 16-128, the cache's layout
                                                  # ([block, token, head, dim] or [block, head,
                                                  # token, dim]) and tiles, longest first
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

import torch

from attention_kernels import bench_graph, check, make_batch, run_triton

# (BLOCK_N, num_warps, num_stages). The default decode tile follows the batch size
# (triton_attention_tiling._pick_config): (32, 2, 3) above 160 sequences, (64, 2, 3) above 96,
# (128, 4, 3) below; (64, 4, 2) with blocks of 128 tokens.
CONFIGS = [(64, 2, 3), (64, 2, 2), (32, 2, 3), (32, 2, 4), (64, 2, 4), (64, 4, 3), (64, 4, 4),
           (128, 2, 3), (128, 4, 3), (128, 8, 3)]


def shapes():
    rng = random.Random(0)
    mixed = [rng.randint(100, 2000) for _ in range(256)]
    return [
        ("256 x U[500,700]", [rng.randint(500, 700) for _ in range(256)]),
        ("256 x U[100,2000]", mixed),
        ("256 x U[100,2000] longest first", sorted(mixed, reverse=True)),
        ("128 x U[800,2000]", [rng.randint(800, 2000) for _ in range(128)]),
        ("32 x U[1000,2000]", [rng.randint(1000, 2000) for _ in range(32)]),
    ]


def tail_shapes():
    """Late decode steps of the throughput workload: the sequences left have long outputs,
    so their contexts are prompt + most of the output."""
    rng = random.Random(1)
    return [(f"{n} x U[900,1900] longest first", sorted((rng.randint(900, 1900) for _ in range(n)),
                                                       reverse=True)) for n in (128, 96, 64, 48, 32, 16)]


def checked_time(ta, batch, out, label: str, **kw) -> float | None:
    """Microseconds per CUDA-graph replay of the kernel launched with `kw`, once its output
    has been checked against the torch reference; None, with a line saying why, for a
    variant that fails (out of resources, or a wrong result)."""
    try:
        check(ta, batch, **kw)
        return bench_graph(run_triton(ta, batch, out, **kw))
    except Exception as e:
        print(f"  {label}: failed ({type(e).__name__}: {e})", flush=True)
        return None


def cache_sweep(ta) -> None:
    rng = random.Random(0)
    shapes = [("256 x U[150,1074]", [rng.randint(100, 1024) + 50 for _ in range(256)]),
              ("256 x U[400,1324]", [rng.randint(100, 1024) + 300 for _ in range(256)]),
              ("192 x U[400,1600]", [rng.randint(400, 1600) for _ in range(192)]),
              ("128 x U[900,1900]", [rng.randint(900, 1900) for _ in range(128)])]
    tiles = [(64, 2, 3), (64, 4, 3), (128, 4, 3), (64, 4, 2), (32, 2, 3), (64, 2, 1), (64, 4, 1),
             (32, 4, 1), (128, 8, 2), (128, 4, 2), (32, 1, 3), (16, 1, 3)]
    for name, ctx in shapes:
        print(f"== {name}", flush=True)
        rows = []
        for head_major, block_size in itertools.product((False, True), (16, 32, 64, 128)):
            layout = "head-major" if head_major else "token-major"
            b = make_batch(ctx, [1] * len(ctx), block_size=block_size, head_major=head_major)
            kv_bytes = b["kv_bytes"]
            order = torch.argsort(-b["seq_lens"]).to(torch.int32)  # longest first
            out = torch.empty_like(b["query"])
            for bn, nw, st in tiles:
                cfg = dict(BLOCK_M=16, BLOCK_N=bn, num_warps=nw, num_stages=st)
                us = checked_time(ta, b, out, f"{layout} block {block_size} {cfg}", _config=cfg, seq_order=order)
                if us is None:
                    continue
                rows.append((us, layout, block_size, bn, nw, st, kv_bytes / us / 1e3))
            del b
        for us, layout, block_size, bn, nw, st, gbps in sorted(rows)[:12]:
            print(f"  {us:7.1f} us {gbps:5.0f} GB/s {layout} block {block_size} BLOCK_N={bn} warps={nw} "
                  f"stages={st}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--tail", action="store_true", help="late-run batch sizes, splits 1-8")
    ap.add_argument("--cache", action="store_true", help="block sizes, cache layouts and tiles")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="fp8: a quantized cache (e4m3, a scale per row), its tiles")
    args = ap.parse_args()
    from rlserve.ops import triton_attention as ta
    if args.cache:
        cache_sweep(ta)
        return
    results = []
    configs, orders, split_counts = CONFIGS, (False, True), (1, 2, 4)
    if args.tail:
        configs, orders, split_counts = [(64, 2, 3), (64, 4, 3), (128, 4, 3)], (True,), (1, 2, 3, 4, 6, 8)
    cache_dtype = None
    if args.kv_cache_dtype == "fp8":  # half the bytes a key: wider key tiles
        cache_dtype, orders, split_counts = torch.float8_e4m3fn, (True,), (1, 2)
        # A fourth number caps the registers a thread (maxnreg): more programs a SM.
        configs = CONFIGS + [(128, 4, 2), (128, 4, 4), (256, 4, 2), (256, 4, 3), (256, 8, 2),
                             (64, 4, 2), (128, 8, 2), (128, 4, 1), (64, 4, 1), (128, 4, 1, 128)]
    for name, ctx in (tail_shapes() if args.tail else shapes()):
        batch = make_batch(ctx, [1] * len(ctx), cache_dtype=cache_dtype)
        kv_bytes = batch["kv_bytes"]
        out = torch.empty_like(batch["query"])
        base = bench_graph(run_triton(ta, batch, out))
        print(f"== {name}: {kv_bytes / 1e6:.0f} MB of K+V; current default {base:.1f} us "
              f"({kv_bytes / base / 1e3:.0f} GB/s)", flush=True)
        rows = []
        for tile, heads_first, splits in itertools.product(configs, orders, split_counts):
            bn, nw, st = tile[:3]
            cap = tile[3] if len(tile) > 3 else None
            cfg = dict(BLOCK_M=16, BLOCK_N=bn, num_warps=nw, num_stages=st, HEADS_FIRST=heads_first)
            if cap:
                cfg["maxnreg"] = cap
            us = checked_time(ta, batch, out, f"{cfg} splits={splits}", _config=cfg, num_kv_splits=splits)
            if us is None:
                continue
            rows.append((us, bn, nw, st, cap, heads_first, splits))
            results.append(dict(shape=name, us=us, block_n=bn, warps=nw, stages=st, maxnreg=cap,
                                heads_first=heads_first, splits=splits, gbps=kv_bytes / us / 1e3))
        for us, bn, nw, st, cap, hf, sp in sorted(rows, key=lambda r: r[0])[:8]:
            print(f"  {us:8.1f} us {kv_bytes / us / 1e3:6.0f} GB/s  BLOCK_N={bn} warps={nw} "
                  f"stages={st}{f' maxnreg={cap}' if cap else ''} heads_first={hf} splits={sp}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
