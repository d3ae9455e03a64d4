"""What programmatic dependent launch (PDL) saves between the small kernels of a decode step.

A CUDA graph of 224 launches on [256, 1024] bf16 activations, timed per launch:

  triton chain       a small Triton kernel after a small Triton kernel
  gemm -> triton     a cuBLAS GEMM (256 x 1024 x 1024) followed by a Triton kernel
each plain, with PDL (the Triton kernel launched early, waiting in griddepcontrol.wait
for its predecessor's memory), and with PDL plus an early trigger (each Triton kernel lets
its successor launch as soon as it has started).

Usage: python benchmarks/pdl_chain.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from attention_kernels import bench_graph

ROWS, COLS, LAUNCHES = 256, 1024, 224


@triton.jit
def scale_rows(x_ptr, y_ptr, WAIT: tl.constexpr, TRIGGER: tl.constexpr, COLS: tl.constexpr):
    """y = x * rsqrt(mean(x^2)): an RMSNorm without weights, one program per row."""
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, COLS)
    x = tl.load(x_ptr + r * COLS + c).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / COLS + 1e-6)
    tl.store(y_ptr + r * COLS + c, y.to(y_ptr.dtype.element_ty))


def main() -> None:
    x = torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    w = torch.randn(COLS, COLS, device="cuda", dtype=torch.bfloat16) / 32

    def norm(src, dst, pdl: bool, trigger: bool):
        scale_rows[(ROWS,)](src, dst, WAIT=pdl, TRIGGER=trigger, COLS=COLS, num_warps=4,
                            launch_pdl=pdl)

    def triton_chain(pdl, trigger):
        def fn():
            for i in range(LAUNCHES // 2):
                norm(x, y, pdl, trigger)
                norm(y, x, pdl, trigger)
        return fn

    def gemm_chain(pdl, trigger):
        def fn():
            for i in range(LAUNCHES // 2):
                torch.mm(x, w, out=y)
                norm(y, x, pdl, trigger)
        return fn

    reference = None
    for name, chain in (("triton chain", triton_chain), ("gemm -> triton", gemm_chain)):
        for label, pdl, trigger in (("plain", False, False), ("pdl", True, False),
                                    ("pdl + trigger", True, True)):
            x.copy_(torch.randn(ROWS, COLS, device="cuda", generator=torch.Generator(
                device="cuda").manual_seed(0)).bfloat16())
            fn = chain(pdl, trigger)
            fn()
            torch.cuda.synchronize()
            out = x.float().clone()
            if label == "plain":
                reference = out
            same = torch.equal(out, reference)
            us = bench_graph(fn)
            print(f"  {name:15s} {label:14s} {us / LAUNCHES:6.2f} us a launch "
                  f"({us:7.1f} us)  same result as plain: {same}", flush=True)


if __name__ == "__main__":
    main()
