"""Bucket plan computed from tensor metadata alone.

The trainer and every receiver call `plan_buckets` on the same (name, dtype,
shape) list and get the same boundaries; `plan_digest` lets them prove it
before any byte moves. Every bucket travels as one uint8 broadcast.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import operator
from array import array
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from .info import DTYPE_NAMES, UpdateInfo

ALIGN_BYTES = 256  # every tensor starts 256-byte aligned: a valid view for any dtype, coalesced copies
PLAN_VERSION = 3  # bump when the layout rules or the digest change (3: the digest hashes the lists' bytes)

# Names as the trainer writes them: str(p.dtype).split(".")[-1].
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES if hasattr(torch, name)}


_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


class TensorMeta(NamedTuple):
    name: str
    dtype_name: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
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


def tensor_metas(info: UpdateInfo) -> list[TensorMeta]:
    """update_info's tensors, one TensorMeta each, in order."""
    # tuple.__new__ straight from C: TensorMeta._make costs a Python frame per name
    return list(map(tuple.__new__, itertools.repeat(TensorMeta), zip(info.names, info.dtype_names, info.shapes)))


class Slot(NamedTuple):
    """Where tensor `index` (position in the meta list) lives inside its bucket."""

    index: int  # type: ignore[assignment]  # the field hides tuple.index, which nothing calls
    offset: int
    nbytes: int


class Bucket(NamedTuple):
    """Tensors first, first + 1, ... at `offsets`, `sizes` bytes each."""

    first: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int  # bytes on the wire (end of the last slot)
    # A direct bucket is one tensor broadcast from/into its own storage (unpacked
    # mode, or a tensor bigger than a packed buffer); others go through the buffer ring.
    direct: bool

    @property
    def slots(self) -> list[Slot]:
        """Made when the bucket is packed or unpacked, not when the plan is: a plan may
        have tens of thousands of tensors, and the transfer's per-tensor work dwarfs this."""
        return list(map(Slot._make, zip(range(self.first, self.first + len(self.offsets)), self.offsets,
                                       self.sizes)))


_name_of, _dtype_of, _shape_of = (operator.itemgetter(i) for i in range(3))  # TensorMeta's fields


def tensor_nbytes(metas: Sequence[TensorMeta]) -> list[int]:
    """Each tensor's size in bytes, computed in bulk (an MoE model sent per expert has tens
    of thousands of tensors)."""
    numels = map(math.prod, map(_shape_of, metas))
    return list(map(int.__mul__, numels, map(_ITEMSIZE.__getitem__, map(_dtype_of, metas))))


def plan_buckets(metas: Sequence[TensorMeta], packed: bool, bucket_size_bytes: int) -> list[Bucket]:
    """Pack tensors in order, each at the next aligned offset; start a new bucket when the
    next one would not fit. A tensor bigger than a bucket (or any, unpacked) goes alone."""
    if bucket_size_bytes <= 0:
        raise ValueError(f"bucket_size_bytes must be > 0, got {bucket_size_bytes}")
    sizes = tensor_nbytes(metas)
    if not packed:
        return [Bucket(i, (0,), (n,), n, True) for i, n in enumerate(sizes)]
    # Vectorized over the tens of thousands of tensors an MoE model may send, looping over
    # buckets only: in a run of tensors that each fit, a tensor's offset in its bucket is
    # the aligned sizes before it since the bucket began, so with S the running sum of
    # aligned sizes, tensor j fits in a bucket begun at s while S[j] + n[j] <= S[s] + size.
    # S[j] + n[j] never decreases, so each bucket's end is one binary search.
    n = np.asarray(sizes, dtype=np.int64)
    aligned = (n + (ALIGN_BYTES - 1)) // ALIGN_BYTES * ALIGN_BYTES
    before = np.concatenate(([0], np.cumsum(aligned)))
    ends = before[:-1] + n
    buckets: list[Bucket] = []
    lone = np.flatnonzero(n > bucket_size_bytes).tolist()
    start = 0
    for stop in lone + [len(sizes)]:
        s = start
        while s < stop:
            j = min(int(np.searchsorted(ends, before[s] + bucket_size_bytes, side="right")), stop)
            offsets = tuple((before[s:j] - before[s]).tolist())
            buckets.append(Bucket(s, offsets, tuple(sizes[s:j]), int(ends[j - 1] - before[s]), False))
            s = j
        if stop < len(sizes):
            buckets.append(Bucket(stop, (0,), (sizes[stop],), sizes[stop], True))
        start = stop + 1
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
    """A hash of plan_json's content: the same lists give the same digest on both sides.
    Hashed as bytes, not as JSON (three times faster for tens of thousands of names): each
    name's length, then the names; the dtype names (a fixed set, none holding a newline)
    joined by newlines; each shape's rank, then the dimensions."""
    header = plan_json((), packed, bucket_size_bytes)  # the fields beside the lists
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    names = list(map(_name_of, metas))
    h.update(array("q", map(len, names)).tobytes())
    h.update("".join(names).encode())
    h.update("\n".join(map(_dtype_of, metas)).encode())
    shapes = list(map(_shape_of, metas))
    h.update(bytes(map(len, shapes)))  # ranks: torch allows at most 64 dimensions
    h.update(array("q", itertools.chain.from_iterable(shapes)).tobytes())
    return h.hexdigest()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (copies only if it is not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)
