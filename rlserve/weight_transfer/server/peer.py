"""Copy a serving replica's weights into a new one, rank to rank (data parallel restarts).

A replica that (re)joins a data-parallel server must serve the weights the others serve
now, not the checkpoint it loaded. Both replicas hold the same shards in the same
parameters (same model, same tensor-parallel size), so rank r of the healthy replica
broadcasts each of its parameters, in `named_parameters` order, straight into rank r of
the new one: a group of two per rank pair, over NCCL between GPUs or gloo on CPU, formed
on the sender's host. Both sides first compare a digest of (name, shape, dtype), so a
mismatch is refused before any byte moves.
"""

from __future__ import annotations

import hashlib

import torch

from rlserve.weight_transfer.errors import InvalidUpdateError
from rlserve.weight_transfer.group import TransferGroup


def layout_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]


def _bytes(p: torch.Tensor) -> torch.Tensor:
    return p.data.reshape(-1).view(torch.uint8)


def copy_parameters(model: torch.nn.Module, *, send: bool, address: str, port: int,
                    device: torch.device, digest: str | None, timeout_s: float) -> int:
    """Send (rank 0) or receive (rank 1) every parameter; returns the bytes moved.

    The receiver's parameters are written in place (the copy lands before it serves).
    `digest`: the other side's layout_digest, unless the caller compared them already."""
    mine = layout_digest(model)
    if digest is not None and mine != digest:
        raise InvalidUpdateError(f"peer weight copy: parameter layouts differ (digest {mine} here, "
                                 f"{digest} at the source): same model and tensor-parallel size?")
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = TransferGroup(backend, address, port, 0 if send else 1, 2, device, timeout_s)
    moved = 0
    try:
        with torch.no_grad(), group.streams():
            for name, p in model.named_parameters():
                if not p.data.is_contiguous():
                    raise InvalidUpdateError(f"peer weight copy: {name} is not contiguous")
                buf = _bytes(p) if backend == "gloo" else p.data
                group.wait(group.broadcast(buf, src=0), f"peer copy of {name}")
                moved += p.numel() * p.element_size()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        group.close()
    return moved
