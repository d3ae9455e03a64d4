"""Where a Triton kernel test runs: on CUDA, or with RLSERVE_TRITON_INTERPRET=1 on the CPU
through Triton's interpreter. Import it before the kernels' modules: it sets
TRITON_INTERPRET before triton.jit decorates them."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from rlserve import envs

INTERPRET = envs.RLSERVE_TRITON_INTERPRET.get()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cpu" if INTERPRET else "cuda"

KERNEL_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                       reason="needs CUDA (or RLSERVE_TRITON_INTERPRET=1)"),
]

# Kernel against reference: tolerances by dtype (relative, per head vector or element).
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# The residual sum is bit-exact on GPU; the interpreter truncates fp32 -> bf16 instead of
# rounding to nearest, which costs up to one bf16 ulp.
EXACT = dict(rtol=2 ** -7, atol=0) if INTERPRET else dict(rtol=0, atol=0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst relative error over the head vectors (a whole-tensor norm hides one bad row)."""
    a, b = a.float(), b.float()
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)
    return err.max().item()
