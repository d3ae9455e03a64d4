"""Torch reference versions of the small fused ops (the oracle for rlserve.ops.triton_fused).

Rounding follows transformers' Llama/Qwen modules, so the fused kernels can match a
trainer's forward pass: the residual sum is rounded to the activation dtype, statistics are
taken in float32, the normalized value is cast back before the weight multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual = x + residual; returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] -> silu(x[..., :I]) * x[..., I:]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary embedding as transformers computes it: x * cos + rotate_half(x) * sin,
    each op rounded to x's dtype (cos and sin already in it)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
