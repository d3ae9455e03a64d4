"""gloo backend (CPU, any host): trainer-side entry points.

Same API as the NCCL engine; the bytes move over framed TCP streams (tcp.py), and
tensors on a GPU are copied to host memory on send.
"""

from __future__ import annotations

import torch

from .engine import TrainerEngine


class GlooWeightTransferEngine(TrainerEngine):
    backend = "gloo"

    @classmethod
    def device(cls, device: torch.device | str | None = None) -> torch.device:
        return torch.device("cpu")  # the group's buffers; the tensors may live anywhere
