"""The Triton fused MoE on its own: one layer of Qwen3-30B-A3B (128 experts, top-8, hidden
2048, expert width 768, bf16) at decode and prefill token counts, routing drawn uniformly,
captured in a CUDA graph and replayed, for several launch shapes of rlserve/ops/triton_moe.py.
Each shape is first checked against the torch reference. The bound is the bytes a step must
read (the touched experts' weights, once) at the peak read rate of the card it runs on
(bounds.py; `--hbm-tb-s` for a card it does not know).

    python benchmarks/moe_kernels.py
    python benchmarks/moe_kernels.py --tokens 1 64 256
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bounds import add_peak_args, device_peak, unknown_card  # noqa: E402
from rlserve.ops import moe as ref  # noqa: E402
from rlserve.ops.triton_moe import DEFAULT_CONFIG, align, block_m_for, fused_moe  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768

CONFIGS = {
    "default (BLOCK_K 128 while BLOCK_M <= 32, else 64)": {},
    "BLOCK_K 64": dict(BLOCK_K=64),
    "BLOCK_K 128": dict(BLOCK_K=128),
    "BLOCK_N 32": dict(BLOCK_N=32),
    "4 stages": dict(stages=4),
    "8 warps, BLOCK_N 128": dict(warps=8, BLOCK_N=128),
}


def layer(tokens: int, gen: torch.Generator):
    x = torch.randn(tokens, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, generator=gen).cuda()
    routing = ref.route(logits, TOP_K, renormalize=True)
    return x, routing


def replay_us(fn, iters: int = 50, calls: int = 10) -> float:
    """Microseconds a call: `calls` calls captured in a CUDA graph, replayed `iters` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512, 4096])
    add_peak_args(p)
    args = p.parse_args()
    peak = device_peak(args.hbm_tb_s, args.tflops)
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN ** 0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER ** 0.5).to("cuda", torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}; one layer: {EXPERTS} experts, top-{TOP_K}, H {HIDDEN}, "
          f"I {INTER}, bf16; default {DEFAULT_CONFIG}")
    print(f"read bound at {peak.describe()}" if peak.hbm_bytes_per_s else unknown_card(peak))
    for tokens in args.tokens:
        x, routing = layer(tokens, gen)
        touched = routing.ids.unique().numel()
        bound_us = touched * 3 * HIDDEN * INTER * 2 / peak.hbm_bytes_per_s * 1e6 if peak.hbm_bytes_per_s else None
        want = ref.fused_moe(x.float(), w13.float(), w2.float(), routing.weights, routing.ids)
        row = []
        for name, cfg in CONFIGS.items():
            got = fused_moe(x, w13, w2, routing.weights, routing.ids, config=cfg)
            err = ((got.float() - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
            if err > 2e-2:
                row.append(f"{name}: WRONG ({err:.3g})")
                continue
            us = replay_us(lambda: fused_moe(x, w13, w2, routing.weights, routing.ids, config=cfg))
            row.append(f"{name}: {us:.1f} us" + (f" ({bound_us / us:.0%})" if bound_us else ""))
        block_m = block_m_for(routing.ids.numel(), EXPERTS)
        row.append(f"align alone: {replay_us(lambda: align(routing.ids, EXPERTS, block_m)):.1f} us")
        bound = f", read bound {bound_us:.1f} us" if bound_us else ""
        print(f"T={tokens:>5} ({touched:>3} experts touched{bound}): " + "; ".join(row))


if __name__ == "__main__":
    main()
