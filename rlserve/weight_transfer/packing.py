"""Bucket plan computed from tensor metadata alone.

The trainer and every receiver call `plan_buckets` on the same (name, dtype,
shape) list and get the same boundaries; `plan_digest` lets them prove it
before any byte moves. Every bucket travels as one uint8 broadcast.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

ALIGN_BYTES = 256  # every tensor starts 256-byte aligned: a valid view for any dtype, coalesced copies
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 512 << 20  # large enough to saturate NVLink, small next to a model
DEFAULT_PACKED_NUM_BUFFERS = 2  # pack/unpack bucket i+1 while bucket i is on the wire
PLAN_VERSION = 2  # bump when the layout rules below change (2: the tensor list as three lists)

# Names as the trainer writes them: str(p.dtype).split(".")[-1].
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
        "int8", "int16", "int32", "int64", "uint8", "bool",
    )
    if hasattr(torch, name)
}


_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


class TensorMeta(NamedTuple):
    name: str
    dtype_name: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype_name]


class Slot(NamedTuple):
    """Where tensor `index` (position in the meta list) lives inside its bucket."""

    index: int
    offset: int
    nbytes: int


class Bucket(NamedTuple):
    slots: tuple[Slot, ...]
    nbytes: int  # bytes on the wire (end of the last slot)
    # A direct bucket is one tensor broadcast from/into its own storage (unpacked
    # mode, or a tensor bigger than a packed buffer); others go through the buffer ring.
    direct: bool


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


def plan_buckets(metas: Sequence[TensorMeta], packed: bool, bucket_size_bytes: int) -> list[Bucket]:
    """Pack tensors in order; start a new bucket when the next one would not fit."""
    if bucket_size_bytes <= 0:
        raise ValueError(f"bucket_size_bytes must be > 0, got {bucket_size_bytes}")
    buckets: list[Bucket] = []
    cur: list[Slot] = []
    end = 0  # the end of the last slot in `cur`
    # The loop runs once per name (tens of thousands for an MoE model sent per expert):
    # locals only, no calls beyond the size itself.
    prod, itemsize, pad = math.prod, _ITEMSIZE, ALIGN_BYTES - 1
    for i, (_, dtype, shape) in enumerate(metas):
        n = prod(shape) * itemsize[dtype]
        if not packed or n > bucket_size_bytes:
            if cur:
                buckets.append(Bucket(tuple(cur), end, False))
                cur = []
            buckets.append(Bucket((Slot(i, 0, n),), n, True))
            continue
        offset = (end + pad) // ALIGN_BYTES * ALIGN_BYTES if cur else 0
        if cur and offset + n > bucket_size_bytes:
            buckets.append(Bucket(tuple(cur), end, False))
            cur, offset = [], 0
        cur.append(Slot(i, offset, n))
        end = offset + n
    if cur:
        buckets.append(Bucket(tuple(cur), end, False))
    return buckets


def ring_buffer_bytes(buckets: Sequence[Bucket]) -> int:
    """Size of each ring buffer: the largest packed bucket (small models get small buffers)."""
    return max((b.nbytes for b in buckets if not b.direct), default=0)


def plan_json(metas: Sequence[TensorMeta], packed: bool, bucket_size_bytes: int) -> dict:
    """The plan's inputs, which determine every bucket boundary (shapes as tuples encode as
    JSON lists, so the dict's JSON is the same on both sides)."""
    # packed_num_buffers is not part of it: the pipeline depth does not change
    # the sequence of broadcasts, so the two sides may differ there.
    return {
        "version": PLAN_VERSION,
        "align": ALIGN_BYTES,
        "packed": bool(packed),
        "bucket_size_bytes": int(bucket_size_bytes) if packed else None,
        # Three parallel lists rather than one list per tensor: a model with many experts
        # has tens of thousands of names, and flat lists of strings encode twice as fast.
        "names": [m[0] for m in metas],
        "dtype_names": [m[1] for m in metas],
        "shapes": [m[2] for m in metas],
    }


def plan_digest(metas: Sequence[TensorMeta], packed: bool, bucket_size_bytes: int) -> str:
    canon = json.dumps(plan_json(metas, packed, bucket_size_bytes), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (copies only if it is not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)
