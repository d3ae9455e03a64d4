"""Routing capture for routing replay (R3): which experts each token went to, at every
MoE layer, recorded on the device as the step runs.

One int32 buffer `[max_tokens, num_hidden_layers, top_k]` is allocated once; each sparse
layer copies its top-k ids into its own column, rows in the step's token order. Nothing
here reads the device from the host, and the buffer never moves, so the copies are
captured into CUDA graphs like the rest of a decode step. Columns of dense layers (Qwen2-
MoE's `mlp_only_layers`, `decoder_sparse_step`) hold -1 for their whole life.

The model runner copies the step's rows to the host with the step's other results; the
engine stores them beside the KV blocks (engine/route_store.py: RouteStore).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch import nn

logger = logging.getLogger(__name__)


class RoutesShape(NamedTuple):
    """The layout of a token's row: vLLM's [num_hidden_layers, num_experts_per_tok]."""

    num_layers: int
    top_k: int


class RoutedExpertsCapturer:
    """The device buffer the sparse layers write into; rows [:n] belong to a step of n tokens."""

    def __init__(self, shape: RoutesShape, max_tokens: int, device: torch.device):
        self.shape = shape
        self.buffer = torch.full((max_tokens, *shape), -1, dtype=torch.int32, device=device)
        # Page-locked host copies, two of them: with overlapped scheduling step N+1's copy is
        # queued before step N's rows are read on the host.
        pin = device.type == "cuda"
        self.host = [torch.empty_like(self.buffer, device="cpu", pin_memory=pin) for _ in range(2)]
        self._turn = 0

    @classmethod
    def attach(cls, model: nn.Module, max_tokens: int, device: torch.device) -> RoutedExpertsCapturer | None:
        """Point every sparse MoE layer of `model` at a new buffer; None (with a warning)
        for a model without one: `--enable-return-routed-experts` on a dense model starts
        the server as if it were off."""
        from rlserve.model.moe import SparseMoeBlock
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        if not blocks:
            logger.warning("enable_return_routed_experts: %s has no mixture-of-experts layers; "
                           "no routes are captured", type(model).__name__)
            return None
        config: Any = model.config
        shape = RoutesShape(int(config.num_hidden_layers), blocks[0].top_k)
        capturer = cls(shape, max_tokens, device)
        for block in blocks:
            block.capture = capturer.buffer[:, block.layer_index]
        return capturer

    def copy_out(self, num_tokens: int) -> torch.Tensor:
        """The step's rows on their way to the host (queued behind the step on the device);
        read them once the step's copy-out event has fired."""
        host = self.host[self._turn][:num_tokens]
        self._turn ^= 1
        host.copy_(self.buffer[:num_tokens], non_blocking=self.buffer.is_cuda)
        return host
