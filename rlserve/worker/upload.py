"""Host arrays to the device in one copy from page-locked memory.

A step's inputs travel as typed groups of arrays (NamedTuples whose fields are numpy
arrays, None where a step has no such part, or another such group): `upload_groups` sends
every array of every group in one copy and gives each group back with device tensors under
the same names. The groups are generic over `ArrayT`: Group[np.ndarray] on the host,
Group[torch.Tensor] on the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np
import torch

_ALIGN = 64  # bytes: every part of an upload starts at a multiple (see `upload`)
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}

# A group's fields: host arrays before the upload, device tensors after it.
ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays (int64, int32 or float32) -> device tensors of the same dtypes and
    shapes, in one copy from page-locked memory.

    A copy from pageable memory would make the host wait for the device's queue to
    drain, which is exactly what overlapped scheduling must avoid. Every part starts
    at a multiple of 64 bytes, as a fresh allocation does: Triton compiles a kernel
    variant per pointer alignment, and a step must not meet a new one.
    """
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf = host.numpy()
    for a, off in zip(arrays, offsets):
        buf[off : off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
    dev = host.to(device, non_blocking=True)
    out = []
    for a, off in zip(arrays, offsets):
        t = dev[off : off + a.nbytes].view(_TORCH_DTYPES[a.dtype])
        out.append(t if a.ndim == 1 else t.view(a.shape))
    return out


def upload_groups(groups: tuple[tuple | None, ...], device: torch.device) -> tuple[Any, ...]:
    """Every array of `groups` (None: no such group this step) in one `upload`; each group
    comes back as the same NamedTuple with device tensors in place of its arrays. Typed Any:
    a Group[np.ndarray] comes back a Group[torch.Tensor], which typing cannot say of a tuple
    of groups; the parameters the callers pass them to name them."""
    arrays: list[np.ndarray] = []
    for group in groups:
        if group is not None:
            _gather(group, arrays)
    tensors = iter(upload(arrays, device))
    return tuple(None if group is None else _rebuild(group, tensors) for group in groups)


def _gather(group: tuple, out: list[np.ndarray]) -> None:
    for value in group:
        if value is not None:
            if type(value) is np.ndarray:
                out.append(value)
            else:
                _gather(value, out)


def _rebuild(group: Any, tensors: Iterator[torch.Tensor]) -> Any:  # a NamedTuple, with tensors for arrays
    return group._make(
        [
            value if value is None else next(tensors) if type(value) is np.ndarray else _rebuild(value, tensors)
            for value in group
        ]
    )
