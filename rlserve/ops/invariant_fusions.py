"""The batch-invariant mode's one-launch kernels on CUDA, each kept only where it gives the
bits of the torch arithmetic it replaces, checked once on the card at start.

The mode promises a trainer's bits: a transformers model under rlserve.batch_invariant runs
RMSNorm's, rotary's and SiLU's elementwise arithmetic as torch ops. Spelled out as torch ops
on the server too they cost about twenty launches a layer. The kernels here do each in one
launch, rounding where torch rounds and calling the functions torch's kernels call (CUDA's
rsqrtf and expf, an IEEE division, no fused multiply-adds), so they should give the same
bits; whether they do rests on the card, the Triton compiler and torch's own kernels, so
each is run on random rows against its torch arithmetic and, where any bit differs, dropped
loudly for the torch ops. The GEMM's faster tiles by row count (triton_batch_invariant.TILES)
are checked the same way, against its one fixed tile.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from rlserve.ops import batch_invariant as bi
from rlserve.ops import fused_ref
from rlserve.ops.self_check import passes

logger = logging.getLogger(__name__)


def _norm_matches(device: torch.device, dtype: torch.dtype) -> bool:
    from rlserve.ops import triton_batch_invariant as tbi
    gen = torch.Generator(device=device).manual_seed(0)
    for n in (128, 576, 2048):
        x = (3 * torch.randn(257, n, device=device, generator=gen)).to(dtype)
        r = torch.randn(257, n, device=device, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(n, device=device, generator=gen)).to(dtype)
        out, res = tbi.rms_norm(x, w, 1e-6, residual=r)
        want_out, want_res = bi.fused_add_rms_norm(x, r, w, 1e-6)
        heads = x.view(257, -1, 64)[:, ::2]  # per-head rows of a strided view, in place
        want_heads = bi.rms_norm(heads, w[:64], 1e-6)
        tbi.rms_norm(heads, w[:64], 1e-6, out=heads)
        if res is None or not (torch.equal(out, want_out) and torch.equal(res, want_res)
                               and torch.equal(heads, want_heads)):
            return False
    return True


def _rope_matches(device: torch.device, dtype: torch.dtype) -> bool:
    from rlserve.ops.triton_rotary import rope_
    gen = torch.Generator(device=device).manual_seed(0)
    dim, positions = 128, torch.arange(0, 4096, 13, device=device)
    # Any float32 table with equal halves, as a rotary table has (the kernel reads one half).
    half = torch.rand(2, 4096, dim // 2, device=device, generator=gen) * 2 - 1
    cos, sin = torch.cat((half[0], half[0]), -1), torch.cat((half[1], half[1]), -1)
    qk = torch.randn(positions.shape[0], 24, dim, device=device, generator=gen).to(dtype)
    c, s = cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)
    want_q, want_k = fused_ref.rotate(qk[:, :16], c, s), fused_ref.rotate(qk[:, 16:], c, s)
    q, k = rope_(qk[:, :16], qk[:, 16:], positions, cos, sin, round_each=True)
    return torch.equal(q, want_q) and torch.equal(k, want_k)


def _silu_matches(device: torch.device, dtype: torch.dtype) -> bool:
    from rlserve.ops import triton_fused
    gen = torch.Generator(device=device).manual_seed(0)
    x = (4 * torch.randn(257, 2 * 1536, device=device, generator=gen)).to(dtype)
    return torch.equal(triton_fused.silu_and_mul(x, exact=True), F.silu(x[:, :1536]) * x[:, 1536:])


def _check(name: str, matches, device: torch.device, dtype: torch.dtype) -> bool:
    return passes(
        f"{name} (batch-invariant mode, one launch)",
        lambda: None if matches(device, dtype) else "its bits differ from torch's arithmetic",
        "it runs as torch ops instead (same bits, more launches)",
    )


def fusions(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The Kernels fields (ops/kernels.py) whose one-launch kernels give torch's bits here."""
    from rlserve.ops import triton_batch_invariant as tbi
    from rlserve.ops import triton_fused, triton_rotary
    out: dict = {}
    norm = _check("RMSNorm", _norm_matches, device, dtype)
    if norm:
        out["rms_norm"] = lambda x, weight, eps: tbi.rms_norm(x, weight, eps)[0].view(x.shape)

        def fused_add_rms_norm(x, residual, weight, eps):
            if x.dim() != 2 or x.stride(-1) != 1 or residual.stride(-1) != 1:
                return bi.fused_add_rms_norm(x, residual, weight, eps)
            return tbi.rms_norm(x, weight, eps, residual=residual)

        out["fused_add_rms_norm"] = fused_add_rms_norm
    if _check("rotary embedding", _rope_matches, device, dtype):
        def rope(q, k, positions, cos, sin, q_weight=None, k_weight=None, eps: float = 1e-6, **store):
            # The per-head norms first, in place, with the mode's RMSNorm; then the rotation
            # (and the KV store) as torch rounds it.
            if q_weight is not None:
                for x, w in ((q, q_weight), (k, k_weight)):
                    if norm:
                        tbi.rms_norm(x, w, eps, out=x)
                    else:
                        x.copy_(bi.rms_norm(x, w, eps))
            return triton_rotary.rope_(q, k, positions, cos, sin, round_each=True, **store)

        out["rope"] = rope
    if _check("SiLU-and-mul", _silu_matches, device, dtype):
        out["silu_and_mul"] = lambda x: triton_fused.silu_and_mul(x, exact=True)
    if tbi.TILES and _check("GEMM's row-count tiles", tbi.check_tiles, device, dtype):
        out_tiles = "row-count GEMM tiles"
    else:
        out_tiles = "fixed GEMM tiles"
    logger.info("batch-invariant mode: one-launch %s; %s", ", ".join(out) or "none", out_tiles)
    return out
