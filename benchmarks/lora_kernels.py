"""Batched LoRA kernels on their own: one decode step's adapter work for Qwen3-0.6B (28
layers x qkv, o, gate_up, down; rank 16; tokens spread over 4 adapters), captured in a CUDA
graph and replayed, for several launch shapes of rlserve/ops/triton_lora.py. Each shape is
first checked against the torch reference.

    python benchmarks/lora_kernels.py            # H200
    python benchmarks/lora_kernels.py --tokens 64
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from rlserve.ops.lora import LoRABatch, group_tokens, lora_reference  # noqa: E402
from rlserve.ops.triton_lora import DEFAULT_CONFIG, lora_shrink_expand  # noqa: E402

HIDDEN, Q, KV, INTER, LAYERS = 1024, 2048, 1024, 3072, 28
# (in features, slice widths) of qkv_proj, o_proj, gate_up_proj, down_proj
SHAPES = [(HIDDEN, [Q, KV, KV]), (Q, [HIDDEN]), (HIDDEN, [INTER, INTER]), (INTER, [HIDDEN])]

CONFIGS = {
    "one program per token tile (split 1)": dict(MAX_SPLIT_K=1),
    "split 2": dict(MAX_SPLIT_K=2),
    "split 4 (default)": dict(MAX_SPLIT_K=4),
    "split 8": dict(MAX_SPLIT_K=8),
    "split 16": dict(MAX_SPLIT_K=16),
    "split 8, BLOCK_K 64": dict(MAX_SPLIT_K=8, BLOCK_K=64),
    "split 16, BLOCK_K 64": dict(MAX_SPLIT_K=16, BLOCK_K=64),
    "split 8, BLOCK_M 32": dict(MAX_SPLIT_K=8, BLOCK_M=32),
    "split 8, BLOCK_M 64": dict(MAX_SPLIT_K=8, BLOCK_M=64),
    "split 8, shrink 2 warps": dict(MAX_SPLIT_K=8, shrink_warps=2),
    "split 8, expand BLOCK_N 64": dict(MAX_SPLIT_K=8, BLOCK_N=64),
    "split 8, expand BLOCK_N 256": dict(MAX_SPLIT_K=8, BLOCK_N=256),
    "split 8, expand 2 warps": dict(MAX_SPLIT_K=8, expand_warps=2),
    "split 8, expand 8 warps, BLOCK_N 256": dict(MAX_SPLIT_K=8, BLOCK_N=256, expand_warps=8),
    "split 8, BLOCK_M 32, BLOCK_N 256": dict(MAX_SPLIT_K=8, BLOCK_M=32, BLOCK_N=256),
}


def layers(tokens: int, slots: int, rank: int, device: str):
    gen = torch.Generator().manual_seed(0)
    out = []
    for k, widths in SHAPES:
        slices = [(sum(widths[:i]), w) for i, w in enumerate(widths)]
        n = sum(widths)
        x = torch.randn(tokens, k, generator=gen).to(device, torch.bfloat16)
        y = torch.randn(tokens, n, generator=gen).to(device, torch.bfloat16)
        a = (torch.randn(slots, len(widths), rank, k, generator=gen) / k ** 0.5).to(device, torch.bfloat16)
        b = (torch.randn(slots, n, rank, generator=gen) * 0.1).to(device, torch.bfloat16)
        table = torch.tensor([[o for o, _ in slices], [w for _, w in slices]], dtype=torch.int32, device=device)
        out.append((x, y, a, b, slices, table))
    order, starts, segments = group_tokens(np.arange(tokens) % slots, slots)
    batch = LoRABatch(torch.from_numpy(order).to(device), torch.from_numpy(starts).to(device), segments)
    return out, batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--replays", type=int, default=50)
    args = p.parse_args()
    shapes, batch = layers(args.tokens, args.adapters, args.rank, "cuda")
    print(f"{args.tokens} tokens over {args.adapters} adapters, rank {args.rank}, {LAYERS} layers; "
          f"defaults {DEFAULT_CONFIG}")
    for name, cfg in CONFIGS.items():
        for x, y, a, b, slices, table in shapes:  # correct before timed
            want, got = y.clone(), y.clone()
            lora_reference(want, x, a, b, slices, batch)
            lora_shrink_expand(got, x, a, b, slices, table, batch.sorted_tokens, batch.slot_starts, cfg)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)

        def step():
            for _ in range(LAYERS):
                for x, y, a, b, slices, table in shapes:
                    lora_shrink_expand(y, x, a, b, slices, table, batch.sorted_tokens, batch.slot_starts, cfg)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"{name:>40}: {start.elapsed_time(end) / args.replays * 1e3:8.1f} us per step")


if __name__ == "__main__":
    main()
