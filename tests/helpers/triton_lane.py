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
