"""The decode GEMMs under torch's two cuBLAS paths: cublas (the default) and cublasLt.

torch picks one kernel per GEMM shape by each library's heuristic; the two libraries can
choose differently for the skinny shapes of a decode batch. For each model's four layer
GEMMs at decode batch sizes and at a full prefill step (16,384 tokens): microseconds per
GEMM (CUDA-graph replay over distinct weights, so every weight read comes from HBM) and
the FLOP rate, which at prefill sizes is the rate the roofline in throughput.py can hope for.

Usage: python benchmarks/gemm_library.py
"""

from __future__ import annotations

import torch

from attention_kernels import bench_graph

MODELS = {  # (name, K, N) per layer GEMM; layers with distinct weights in the graph
    "qwen3-0.6b": ([("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024)], 28),
    "llama-3.1-8b": ([("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)], 6),
}
ROWS = (16384, 256, 192, 128, 64, 16)
LIBRARIES = ("cublas", "cublaslt")


def main() -> None:
    dtype = torch.bfloat16
    for model, (shapes, layers) in MODELS.items():
        print(f"{model}:", flush=True)
        for name, k, n in shapes:
            weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.03 for _ in range(layers)]
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                cells = []
                for lib in LIBRARIES:
                    torch.backends.cuda.preferred_blas_library(lib)
                    iters = 10 if m > 4096 else 30
                    t = bench_graph(lambda: [torch.nn.functional.linear(x, w) for w in weights], iters=iters) / layers
                    cells.append(f"{lib} {t:7.2f} us ({2 * m * n * k / t / 1e6:5.0f} TFLOP/s)")
                print(f"  {name:<8} K={k:<6} N={n:<6} M={m:<4} " + " | ".join(cells), flush=True)
            del weights
    torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
