"""NCCL backend (trainer and server on different GPUs): trainer-side entry points.

The receiving side is backend-agnostic: see `receiver.py`.
"""

from __future__ import annotations

import torch

from .trainer import TrainerEngine


class NCCLWeightTransferEngine(TrainerEngine):
    """`trainer_init` uses the current CUDA device (call torch.cuda.set_device first)."""

    backend = "nccl"

    @classmethod
    def device(cls) -> torch.device:
        if not torch.cuda.is_available():
            raise RuntimeError("NCCLWeightTransferEngine needs CUDA; use GlooWeightTransferEngine on CPU")
        return torch.device("cuda", torch.cuda.current_device())
