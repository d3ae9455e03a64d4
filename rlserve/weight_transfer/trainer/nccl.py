"""NCCL backend (trainer and server on different GPUs): trainer-side entry points.

The receiving side is backend-agnostic: see `receiver.py`.
"""

from __future__ import annotations

import torch

from .engine import TrainerEngine


class NCCLWeightTransferEngine(TrainerEngine):
    """`trainer_init(init_info, device=...)` forms the group on the GPU the tensors to send
    are on; without `device` (as vLLM's RLHF-over-HTTP example calls it) it uses the current CUDA device."""

    backend = "nccl"

    @classmethod
    def device(cls, device: torch.device | str | None = None) -> torch.device:
        if not torch.cuda.is_available():
            raise RuntimeError("NCCLWeightTransferEngine needs CUDA; use GlooWeightTransferEngine on CPU")
        if device is None:
            return torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the nccl backend sends from a CUDA device, got device={device}")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
