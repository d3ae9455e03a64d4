"""Batched LoRA: y += (x A_i^T) B_i^T for each token's adapter i, several adapters (and
the base model, which adds nothing) in one batch.

Weights are stacked per layer, one row per adapter slot: `a` [slots, num_slices, rank, in]
and `b` [slots, out, rank], where a fused layer (qkv, gate_up) has one slice per fused
projection and slice s's rows of `b` are y's columns `slices[s]`. Each adapter's scaling
is folded into its `b` when it is loaded, so nothing here scales.

A step's tokens are grouped by adapter (`LoRABatch`): `sorted_tokens` lists the token rows
of slot 0, then slot 1, ..., `slot_starts[s]:slot_starts[s + 1]` delimiting slot s; the
base model's tokens come last and are not touched. The torch reference (CPU, and the
oracle) shrinks and expands one adapter at a time; on CUDA two Triton kernels do the
same for every adapter at once, inside CUDA graphs (triton_lora.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


class LoRABatch(NamedTuple):
    """Which tokens of a step use which adapter slot."""

    sorted_tokens: torch.Tensor  # [num_tokens] int32: token rows, grouped by slot
    slot_starts: torch.Tensor  # [max_loras + 1] int32: slot s's tokens are [starts[s], starts[s+1])
    # (slot, start, end) of each slot that has tokens, on the host; None: read slot_starts
    segments: tuple[tuple[int, int, int], ...] | None = None


def group_tokens(token_slots: np.ndarray, max_loras: int) -> tuple[np.ndarray, np.ndarray,
                                                                   tuple[tuple[int, int, int], ...]]:
    """Host side of a LoRABatch: the token rows grouped by slot (base tokens, slot -1, last),
    each slot's start, and the non-empty segments."""
    keys = np.where(token_slots < 0, max_loras, token_slots)
    order = np.argsort(keys, kind="stable").astype(np.int32)
    starts = np.searchsorted(keys[order], np.arange(max_loras + 1)).astype(np.int32)
    segments = tuple((s, int(starts[s]), int(starts[s + 1])) for s in range(max_loras)
                     if starts[s + 1] > starts[s])
    return order, starts, segments


def lora_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   slices: list[tuple[int, int]], batch: LoRABatch,
                   linear: Callable[..., torch.Tensor] = F.linear) -> None:
    """Adds each token's adapter delta to y [T, out] in place; x [T, in]. Computed in
    float32 and rounded once, as a merged weight's product would be. `linear`: the shrink
    and expand GEMMs (the batch-invariant mode passes its own)."""
    segments = batch.segments
    if segments is None:
        starts = batch.slot_starts.tolist()
        segments = tuple((s, starts[s], starts[s + 1]) for s in range(len(starts) - 1)
                         if starts[s + 1] > starts[s])
    acc = torch.promote_types(x.dtype, torch.float32)
    for slot, start, end in segments:
        rows = batch.sorted_tokens[start:end].long()
        xs = x.index_select(0, rows).to(acc)
        delta = torch.empty((end - start, y.shape[1]), dtype=acc, device=y.device)
        for s, (offset, size) in enumerate(slices):
            u = linear(xs, a[slot, s].to(acc))  # shrink: [n, rank]
            delta[:, offset:offset + size] = linear(u, b[slot, offset:offset + size].to(acc))  # expand
        y.index_add_(0, rows, delta.to(y.dtype))
