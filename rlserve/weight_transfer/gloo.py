"""gloo backend (CPU tensors, any host): trainer-side entry points.

Same API as the NCCL engine; tensors on other devices are copied to CPU on send.
"""

from __future__ import annotations

import torch

from .trainer import TrainerEngine


class GlooWeightTransferEngine(TrainerEngine):
    backend = "gloo"

    @classmethod
    def device(cls) -> torch.device:
        return torch.device("cpu")
