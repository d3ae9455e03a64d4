"""The batch-invariant Triton kernels (rlserve/ops/triton_batch_invariant.py) against torch:
close to it, and a row's bits independent of the other rows.

Needs CUDA and triton; skipped otherwise. With RLSERVE_TRITON_INTERPRET=1 the kernels run on
CPU tensors through Triton's interpreter instead (small shapes, float32)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from rlserve import envs

INTERPRET = envs.RLSERVE_TRITON_INTERPRET.get()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit decorates the kernels

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                       reason="needs CUDA (or RLSERVE_TRITON_INTERPRET=1)"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(96, 80), (200, 64)] if INTERPRET else [(1024, 1024), (4096, 1024), (151936, 1024)])
def test_matmul_rows_are_independent_of_the_batch(dtype, n, k):
    from rlserve.ops import triton_batch_invariant as tbi
    torch.manual_seed(0)
    m = 70 if INTERPRET else 300
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype)
    together = tbi.linear(x, w, b)
    torch.testing.assert_close(together.float(), F.linear(x.float(), w.float(), b.float()),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                               atol=5e-2 if dtype == torch.bfloat16 else 1e-4)
    for i in (0, 1, m // 2, m - 1):
        # Fewer rows, the row at the same place in its tile: the K order does not follow M.
        assert torch.equal(tbi.linear(x[:i + 1], w, b)[i], together[i]), i
    if not INTERPRET:  # the interpreter's dot is numpy's, whose order may follow the row's place
        for i in (0, 1, m // 2, m - 1):
            assert torch.equal(tbi.linear(x[i:i + 1], w, b)[0], together[i]), i
        assert torch.equal(tbi.linear(x[3:40], w, b), together[3:40])


@pytest.mark.parametrize("n", [576, 1000] if INTERPRET else [576, 1024, 4096, 5120])
def test_row_mean_rows_are_independent_of_the_batch(n):
    from rlserve.ops import triton_batch_invariant as tbi
    torch.manual_seed(0)
    m = 33 if INTERPRET else 513
    x = torch.randn(m, n, device=DEVICE)
    together = tbi.row_mean(x)
    torch.testing.assert_close(together, x.mean(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    for i in (0, m // 2, m - 1):
        assert torch.equal(tbi.row_mean(x[i:i + 1]), together[i:i + 1]), i
    assert tbi.row_mean(x.view(3, 11 if INTERPRET else 171, n)).shape[:-1] == (3, 11 if INTERPRET else 171)


@pytest.mark.skipif(INTERPRET, reason="the CUDA dispatch of the batch-invariant ops")
def test_the_ops_take_the_kernels_on_cuda_and_stay_invariant():
    from rlserve.ops import batch_invariant as bi
    torch.manual_seed(0)
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    normed = bi.rms_norm(x, w, 1e-6)
    assert all(torch.equal(bi.rms_norm(x[i:i + 1], w, 1e-6)[0], normed[i]) for i in (0, 17, 255))
    q = torch.randn(300, 16, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
    whole = bi.attention(q, kv, kv, 0, 128 ** -0.5)
    chunked = torch.cat([bi.attention(q[:100], kv[:100], kv[:100], 0, 128 ** -0.5),
                         bi.attention(q[100:], kv, kv, 100, 128 ** -0.5)])
    assert torch.equal(whole, chunked)
