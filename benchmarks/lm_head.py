"""The LM head's GEMM at decode batch sizes (Qwen3-0.6B: vocabulary 151,936, hidden 1024,
bf16), four ways to launch it, each timed as 20 calls in one CUDA graph (no launch cost):

    python benchmarks/lm_head.py

F.linear as the model runs it; torch.mm into a preallocated output; the transposed product
W @ h^T (vocabulary on the GEMM's long side); the vocabulary in 2 or 4 chunks. TB/s counts
one read of the weights, TFLOP/s the product's 2 * M * V * H.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, HIDDEN = 151936, 1024


def graph_us(fn, calls: int = 20, repeats: int = 5) -> float:
    """Best microseconds per call over `repeats` replays of `calls` calls in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main() -> None:
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    weight_bytes = weight.numel() * weight.element_size()
    for rows in (256, 128, 64, 16, 1):
        h = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, VOCAB, device="cuda", dtype=torch.bfloat16)
        out_t = torch.empty(VOCAB, rows, device="cuda", dtype=torch.bfloat16)
        ways = {"F.linear": lambda: F.linear(h, weight),
                "mm into out": lambda: torch.mm(h, weight.t(), out=out),
                "W @ h^T": lambda: torch.mm(weight, h.t(), out=out_t)}
        for n in (2, 4):
            chunks = weight.chunk(n)
            ways[f"{n} vocab chunks"] = lambda chunks=chunks: [F.linear(h, w) for w in chunks]
        for name, fn in ways.items():
            us = graph_us(fn)
            print(f"M={rows:4d} {name:14s} {us:7.1f} us  {weight_bytes / us / 1e6:5.2f} TB/s  "
                  f"{2 * rows * VOCAB * HIDDEN / us / 1e6:6.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
