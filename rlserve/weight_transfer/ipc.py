"""CUDA IPC backend: the trainer and the server share one GPU (colocated RL).

NCCL refuses two ranks on one device, so here the trainer exports CUDA IPC handles to
its parameters' storage and the server copies straight out of the trainer's memory:
one device-to-device copy per tensor, no host round trip, no broadcast.

    sender = IPCWeightTransferEngine.trainer_init()          # the export cache
    IPCWeightTransferEngine.trainer_send_weights(model.named_parameters(),
                                                 {"url": "http://localhost:8000"}, group=sender)

Each storage is exported once (`_share_cuda_`) and opened once on the server, which keeps
it open: a later push is a small JSON document and the copies. A parameter whose storage
was reallocated shows up as a storage the server has not seen; it is exported, opened,
and the stale one released, within that push.

Wire format (`update_info.ipc_handles`, JSON; bytes are base64)::

    {"device_uuid": "GPU-...",
     "storages": [{"handle", "size_bytes", "offset_bytes", "ref_counter_handle",
                   "ref_counter_offset", "event_handle", "event_sync_required"}, ...],
     "tensors":  [{"storage": index into storages, "offset": elements, "stride": [...]}, ...]}

`tensors` is aligned with update_info's names/dtype_names/shapes. Every field is checked
before anything is opened, and every view is checked to lie inside its storage, so a
malformed document is a 400 that names the field, never a crash or a stray read.

A document may carry an `"id"` (the sender's name for exactly this set of handles). A
trainer whose tensors still sit where they sat may then send only a reference to the last
document the server accepted, ``update_info = {"ipc_handles": {"same_as": id}}`` (plus
weight_version, lora_name, ...): a few hundred bytes instead of a few hundred kB of JSON for
a model's or an adapter's hundreds of tensors. A server that holds no such document (it
restarted, or took another one since) refuses the reference with a 400 naming
`update_info.ipc_handles.same_as`, and the sender sends the whole document again.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import InvalidUpdateError
from .packing import TensorMeta

MAX_HANDLE_BYTES = 1024  # a CUDA IPC handle is 64 bytes (plus a type tag in newer torch)
MAX_DOCUMENT_ID = 64
# torch names its IPC reference-counter files /torch_<pid>_<n>...; nothing else may be mapped.
_REF_COUNTER_NAME = re.compile(r"/torch_[A-Za-z0-9_]{1,100}")
_REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE
_STORAGE_FIELDS = ("handle", "size_bytes", "offset_bytes", "ref_counter_handle",
                   "ref_counter_offset", "event_handle", "event_sync_required")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _check_fields(data: Any, fields: Sequence[str], where: str) -> None:
    """`data` must be an object with exactly `fields`; every problem is named at once."""
    if not isinstance(data, Mapping):
        raise InvalidUpdateError(f"{where}: must be an object with {', '.join(fields)}")
    missing = [k for k in fields if k not in data]
    unknown = sorted(set(data) - set(fields))
    problems = [f"missing {', '.join(missing)}"] if missing else []
    if unknown:
        problems.append(f"unknown field(s) {', '.join(unknown)}")
    if problems:
        raise InvalidUpdateError(f"{where}: " + "; ".join(problems))


def device_uuid(device: torch.device | int | None = None) -> str:
    """The GPU's UUID: indices differ between processes with different CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass(frozen=True)
class SharedStorage:
    """One exported CUDA storage, as `UntypedStorage._share_cuda_` describes it."""

    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    @property
    def key(self) -> tuple[bytes, int, int]:
        """Identifies the storage within the trainer's allocation: the server's cache key."""
        return self.handle, self.offset_bytes, self.size_bytes

    def to_json(self) -> dict[str, Any]:
        return {"handle": _b64(self.handle), "size_bytes": self.size_bytes,
                "offset_bytes": self.offset_bytes,
                "ref_counter_handle": _b64(self.ref_counter_handle),
                "ref_counter_offset": self.ref_counter_offset,
                "event_handle": _b64(self.event_handle),
                "event_sync_required": self.event_sync_required}

    @classmethod
    def parse(cls, data: Any, where: str) -> SharedStorage:
        _check_fields(data, _STORAGE_FIELDS, where)

        def raw(field: str, allow_empty: bool = False) -> bytes:
            value = data[field]
            try:
                out = base64.b64decode(value, validate=True) if isinstance(value, str) else None
            except (binascii.Error, ValueError):
                out = None
            if out is None or len(out) > MAX_HANDLE_BYTES or (not out and not allow_empty):
                raise InvalidUpdateError(f"{where}.{field}: must be base64 of 1..{MAX_HANDLE_BYTES} bytes")
            return out

        handle, event = raw("handle"), raw("event_handle", allow_empty=True)
        counter = raw("ref_counter_handle")
        if not _REF_COUNTER_NAME.fullmatch(counter.decode("latin-1")):
            raise InvalidUpdateError(f"{where}.ref_counter_handle: not a torch IPC counter name")
        size, offset, slot = data["size_bytes"], data["offset_bytes"], data["ref_counter_offset"]
        if not (_is_int(size) and size > 0):
            raise InvalidUpdateError(f"{where}.size_bytes: must be a positive integer, got {size!r}")
        if not (_is_int(offset) and offset >= 0):
            raise InvalidUpdateError(f"{where}.offset_bytes: must be a non-negative integer, got {offset!r}")
        if not (_is_int(slot) and 0 <= slot < _REF_COUNTER_SLOTS):
            raise InvalidUpdateError(f"{where}.ref_counter_offset: must be an integer in "
                                     f"0..{_REF_COUNTER_SLOTS - 1}, got {slot!r}")
        sync = data["event_sync_required"]
        if not isinstance(sync, bool):
            raise InvalidUpdateError(f"{where}.event_sync_required: must be true or false")
        if sync and not event:
            raise InvalidUpdateError(f"{where}.event_handle: required when event_sync_required")
        return cls(handle, size, offset, counter, slot, event, sync)


@dataclass(frozen=True)
class SharedTensor:
    storage: int  # index into IPCHandles.storages
    offset: int  # in elements of the tensor's dtype
    stride: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"storage": self.storage, "offset": self.offset, "stride": list(self.stride)}


@dataclass(frozen=True)
class IPCHandles:
    device_uuid: str
    storages: tuple[SharedStorage, ...]
    tensors: tuple[SharedTensor, ...]

    def to_json(self) -> dict[str, Any]:
        return {"device_uuid": self.device_uuid,
                "storages": [s.to_json() for s in self.storages],
                "tensors": [t.to_json() for t in self.tensors]}

    @classmethod
    def parse(cls, data: Any, metas: Sequence[TensorMeta]) -> IPCHandles:
        """Validate `update_info.ipc_handles` against the update's names, dtypes and shapes."""
        where = "update_info.ipc_handles"
        if data is None:
            raise InvalidUpdateError(f"{where}: required with the ipc backend (the trainer's "
                                     "IPCWeightTransferEngine fills it in)")
        if isinstance(data, Mapping) and "id" in data:
            if not (isinstance(data["id"], str) and 0 < len(data["id"]) <= MAX_DOCUMENT_ID):
                raise InvalidUpdateError(f"{where}.id: must be a string of 1 to {MAX_DOCUMENT_ID} characters")
            data = {k: v for k, v in data.items() if k != "id"}
        _check_fields(data, ("device_uuid", "storages", "tensors"), where)
        uuid, storages, tensors = data["device_uuid"], data["storages"], data["tensors"]
        if not (isinstance(uuid, str) and uuid):
            raise InvalidUpdateError(f"{where}.device_uuid: must be a non-empty string")
        if not isinstance(storages, list):
            raise InvalidUpdateError(f"{where}.storages: must be a list")
        if not isinstance(tensors, list) or len(tensors) != len(metas):
            got = len(tensors) if isinstance(tensors, list) else type(tensors).__name__
            raise InvalidUpdateError(f"{where}.tensors: must be a list with one entry per name "
                                     f"({len(metas)}), got {got}")
        parsed = tuple(SharedStorage.parse(s, f"{where}.storages[{i}]") for i, s in enumerate(storages))
        out = []
        for i, (t, meta) in enumerate(zip(tensors, metas)):
            at = f"{where}.tensors[{i}] ({meta.name})"
            _check_fields(t, ("storage", "offset", "stride"), at)
            s, offset, stride = t["storage"], t["offset"], t["stride"]
            if not (_is_int(s) and 0 <= s < len(parsed)):
                raise InvalidUpdateError(f"{at}.storage: must index storages (0..{len(parsed) - 1}), got {s!r}")
            if not (_is_int(offset) and offset >= 0):
                raise InvalidUpdateError(f"{at}.offset: must be a non-negative integer, got {offset!r}")
            if not (isinstance(stride, list) and len(stride) == len(meta.shape)
                    and all(_is_int(x) and x >= 0 for x in stride)):
                raise InvalidUpdateError(f"{at}.stride: must be {len(meta.shape)} non-negative "
                                         f"integers, got {stride!r}")
            if meta.numel:
                last = offset + sum((n - 1) * st for n, st in zip(meta.shape, stride))
                end_bytes = (last + 1) * meta.dtype.itemsize
                if end_bytes > parsed[s].size_bytes:
                    raise InvalidUpdateError(f"{at}: the view ends at byte {end_bytes}, past the end "
                                             f"of its storage ({parsed[s].size_bytes} bytes)")
            out.append(SharedTensor(s, offset, tuple(stride)))
        return cls(uuid, parsed, tuple(out))


# -- server side ---------------------------------------------------------------------------

_SEED_INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")


def parse_ipc_init_info(data: Any) -> None:
    """The ipc backend forms no group: `{}` is the init_info. The group fields of vLLM's RLHF-over-HTTP example are
    accepted and ignored, so a script written for nccl needs no change to its init call."""
    if not isinstance(data, Mapping):
        raise InvalidUpdateError("init_info must be a JSON object ({} for the ipc backend)")
    unknown = sorted(set(data) - set(_SEED_INIT_FIELDS))
    if unknown:
        raise InvalidUpdateError(f"init_info: unknown field(s) {', '.join(unknown)}; the ipc "
                                 "backend takes {} (the group fields of an NCCL or gloo group are ignored)")


def view_of(storage: torch.UntypedStorage, meta: TensorMeta, t: SharedTensor) -> torch.Tensor:
    """The tensor `meta` at (offset, stride) in `storage`; IPCHandles.parse checked the bounds."""
    view = torch.empty(0, dtype=meta.dtype, device=storage.device)
    return view.set_(storage, t.offset, meta.shape, t.stride)
