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
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import InvalidUpdateError
from .packing import TensorMeta, dtype_name

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
    def parse(cls, data: Any, where: str) -> "SharedStorage":
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
    def parse(cls, data: Any, metas: Sequence[TensorMeta]) -> "IPCHandles":
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
    """The ipc backend forms no group: `{}` is the init_info. The seed's group fields are
    accepted and ignored, so a script written for nccl needs no change to its init call."""
    if not isinstance(data, Mapping):
        raise InvalidUpdateError("init_info must be a JSON object ({} for the ipc backend)")
    unknown = sorted(set(data) - set(_SEED_INIT_FIELDS))
    if unknown:
        raise InvalidUpdateError(f"init_info: unknown field(s) {', '.join(unknown)}; the ipc "
                                 "backend takes {} (the seed's group fields are ignored)")


def view_of(storage: torch.UntypedStorage, meta: TensorMeta, t: SharedTensor) -> torch.Tensor:
    """The tensor `meta` at (offset, stride) in `storage`; IPCHandles.parse checked the bounds."""
    view = torch.empty(0, dtype=meta.dtype, device=storage.device)
    return view.set_(storage, t.offset, meta.shape, t.stride)


class IPCReceiver:
    """Opens the trainer's storages once and keeps them open between updates.

    `open` returns views into the trainer's memory; the caller copies them into the model
    between steps, and the trainer does not touch its parameters until the update call
    returns. Storages absent from an update are released (the trainer reallocated them).
    """

    def __init__(self, device: torch.device):
        self.device = device  # a CUDA device: EngineConfig refuses ipc anywhere else
        self.uuid = device_uuid(device)
        self._storages: dict[tuple[bytes, int, int], torch.UntypedStorage] = {}
        # The last accepted update (less its version), its views, its tensors' metadata and
        # the checks it passed: a trainer pushing the same parameters again sends the same
        # document (or a reference to it), which then needs no parsing.
        self._last: tuple[dict, list, list[TensorMeta], tuple] | None = None

    def receive(self, update_info: Mapping[str, Any], expected: Mapping[str, Any],
                validate: Callable[[Sequence[TensorMeta]], None] | None = None
                ) -> list[tuple[str, torch.Tensor]]:
        """Validate update_info (seed fields + ipc_handles) against the model (and with
        `validate`, as receiver.receive_weights does) and open it."""
        from .receiver import UpdateInfo, check_against_model
        if not isinstance(update_info, Mapping):
            raise InvalidUpdateError("update_info must be a JSON object")
        handles = update_info.get("ipc_handles")
        if is_reference(update_info):
            return self._reference(update_info, handles, expected, validate)
        body = {k: v for k, v in update_info.items() if k != "weight_version"}
        if self._last is not None and self._last[0] == body:
            return self._vetted(expected, validate)
        info = UpdateInfo.parse(update_info)
        metas = info.metas()
        check_against_model(metas, expected)
        if validate is not None:
            validate(metas)
        views = self.open(IPCHandles.parse(info.ipc_handles, metas), metas)
        self._last = (body, views, metas, (expected, validate))
        return views

    def _vetted(self, expected: Mapping[str, Any], validate: Callable | None) -> list[tuple[str, torch.Tensor]]:
        """The last document's views, checked again unless against these very checks."""
        body, views, metas, (last_expected, last_validate) = self._last
        if expected is not last_expected or validate is not last_validate:
            from .receiver import check_against_model
            check_against_model(metas, expected)
            if validate is not None:
                validate(metas)
            self._last = (body, views, metas, (expected, validate))
        return views

    def _reference(self, update_info: Mapping[str, Any], handles: Mapping[str, Any],
                   expected: Mapping[str, Any], validate: Callable | None) -> list[tuple[str, torch.Tensor]]:
        """The views of the last accepted document, which `handles.same_as` names."""
        where = "update_info.ipc_handles"
        if len(handles) != 1:
            raise InvalidUpdateError(f"{where}: same_as comes alone (got {', '.join(sorted(handles))})")
        extra = [k for k in ("names", "dtype_names", "shapes") if k in update_info]
        if extra:
            raise InvalidUpdateError(f"update_info: {', '.join(extra)} and ipc_handles.same_as exclude each "
                                     "other (a reference repeats the document it names)")
        last_id = None if self._last is None else self._last[0]["ipc_handles"].get("id")
        if last_id is None or handles["same_as"] != last_id:
            raise InvalidUpdateError(
                f"{where}.same_as: this server holds no document {handles['same_as']!r} (it restarted, "
                "or took another document since): send the whole document")
        return self._vetted(expected, validate)

    def open(self, handles: IPCHandles, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
        if handles.device_uuid != self.uuid:
            raise InvalidUpdateError(
                f"update_info.ipc_handles.device_uuid: the trainer's tensors are on {handles.device_uuid}, "
                f"this server is on {self.uuid}; CUDA IPC needs both on the same GPU (use nccl)")
        kept: dict[tuple[bytes, int, int], torch.UntypedStorage] = {}
        with torch.cuda.device(self.device):
            for i, s in enumerate(handles.storages):
                if s.key in kept:
                    continue
                storage = self._storages.get(s.key)
                if storage is None:
                    try:
                        storage = torch.UntypedStorage._new_shared_cuda(
                            self.device.index, s.handle, s.size_bytes, s.offset_bytes,
                            s.ref_counter_handle, s.ref_counter_offset, s.event_handle,
                            s.event_sync_required)
                    except Exception as e:  # a bad or stale handle: nothing was touched
                        raise InvalidUpdateError(f"update_info.ipc_handles.storages[{i}]: cannot "
                                                 f"open the handle ({e})") from e
                kept[s.key] = storage
            views = [(meta.name, view_of(kept[handles.storages[t.storage].key], meta, t))
                     for meta, t in zip(metas, handles.tensors)]
        # Only now, with every handle open: drop what the trainer no longer sends.
        self._storages = kept
        return views


# -- trainer side --------------------------------------------------------------------------

class IPCSender:
    """The trainer's export cache: one `_share_cuda_` per storage, reused by every push.

    Keyed by the storage's address, with the storage held, so an address cannot be
    recycled while its entry lives; entries a push no longer mentions are dropped. Each
    channel (the base weights, each LoRA adapter) keeps its own exports and its own last
    document, so pushes of one do not evict the other's.
    """

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.uuid = device_uuid(self.device)
        self._channels: dict[str | None, _Channel] = {}
        self.exported_last = 0  # storages the last push exported (0 once warm)

    def update_info(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                    weight_version: int | None = None, *, channel: str | None = None,
                    reference: bool = False) -> dict[str, Any]:
        """The /update_weights payload for these tensors (seed fields + ipc_handles).

        With `reference`, a push whose document equals the last one the server accepted
        on this channel (`accepted`) is sent as a reference to it (ipc_handles.same_as)."""
        ch = self._channels.setdefault(channel, _Channel())
        named = list(named_tensors)
        # The same tensors at the same addresses as last time (their storages are held in
        # `exports`, so an address cannot have been recycled): the document is unchanged.
        signature = [(name, t.is_cuda, t.data_ptr(), t.shape, t.stride(), t.dtype) for name, t in named]
        if signature != ch.signature:
            self._build(ch, named)
            ch.signature = signature
        else:
            self.exported_last = 0
        # The server reads these bytes as soon as it has the handles: finish pending writes
        # (the optimizer step) first. Cached handles carry no event of their own.
        torch.cuda.current_stream(self.device).synchronize()
        if reference and ch.accepted:
            info: dict[str, Any] = {"ipc_handles": {"same_as": ch.doc_id}}
        else:
            info = {**ch.doc, "ipc_handles": {**ch.doc["ipc_handles"], "id": ch.doc_id}}
        if weight_version is not None:
            info["weight_version"] = weight_version
        return info

    def _build(self, ch: "_Channel", named: list[tuple[str, torch.Tensor]]) -> None:
        """Export what is new and write the channel's document."""
        names, dtypes, shapes, tensors = [], [], [], []
        storages: list[dict[str, Any]] = []
        index: dict[int, int] = {}
        exports: dict[int, tuple[torch.UntypedStorage, dict[str, Any]]] = {}
        exported = 0
        for name, t in named:
            t = t.detach()
            if t.device.type != "cuda":
                raise ValueError(f"{name}: the ipc backend shares CUDA tensors, this one is on {t.device}")
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in index:
                entry = ch.exports.get(ptr)
                if entry is None or entry[0].nbytes() != storage.nbytes():
                    entry = (storage, _export(storage).to_json())
                    exported += 1
                exports[ptr] = entry
                index[ptr] = len(storages)
                storages.append(entry[1])
            names.append(name)
            dtypes.append(dtype_name(t.dtype))
            shapes.append(list(t.shape))
            tensors.append(SharedTensor(index[ptr], t.storage_offset(), tuple(t.stride())).to_json())
        ch.exports = exports
        self.exported_last = exported
        doc: dict[str, Any] = {"names": names, "dtype_names": dtypes, "shapes": shapes,
                               "ipc_handles": {"device_uuid": self.uuid, "storages": storages,
                                               "tensors": tensors}}
        if doc != ch.doc:
            ch.doc, ch.doc_id, ch.accepted = doc, secrets.token_hex(8), False

    def accepted(self, info: Mapping[str, Any], channel: str | None = None) -> None:
        """The server took `info` (so holds its document): later pushes may refer to it."""
        ch = self._channels.get(channel)
        handles = info.get("ipc_handles", {})
        if ch is not None and ch.doc_id in (handles.get("id"), handles.get("same_as")):
            ch.accepted = True

    def forget(self, channel: str | None = None) -> None:
        """The server no longer holds this channel's document: send it whole next time."""
        if channel in self._channels:
            self._channels[channel].accepted = False


@dataclass
class _Channel:
    exports: dict[int, tuple[torch.UntypedStorage, dict[str, Any]]] = field(default_factory=dict)
    doc: dict[str, Any] | None = None  # the last document built (less its id and version)
    signature: list | None = None  # (name, on CUDA, address, shape, stride, dtype) of its tensors
    doc_id: str | None = None
    accepted: bool = False  # the server holds `doc`


def is_reference(info: Mapping[str, Any]) -> bool:
    handles = info.get("ipc_handles")
    return isinstance(handles, Mapping) and "same_as" in handles


def _export(storage: torch.UntypedStorage) -> SharedStorage:
    (_device, handle, size, offset, counter, counter_offset, event,
     sync) = storage._share_cuda_()
    return SharedStorage(bytes(handle), int(size), int(offset), bytes(counter), int(counter_offset),
                         bytes(event or b""), bool(sync))


_IGNORED_ARGS = frozenset({"mode", "send_mode", "packed", "packed_buffer_size_bytes", "packed_num_buffers",
                           "checksum"})


class IPCWeightTransferEngine:
    """Seed-style trainer entry points for the ipc backend.

    The server's /init_weight_transfer_engine takes `{"init_info": {}}` (no group to form).
    `trainer_send_weights` posts /update_weights itself (the handles travel in it), or
    hands the payload to `trainer_args["send"]`, a callable, for a custom transport.
    """

    backend = "ipc"

    @classmethod
    def trainer_init(cls, init_info: Mapping[str, Any] | None = None) -> IPCSender:
        if not torch.cuda.is_available():
            raise RuntimeError("IPCWeightTransferEngine needs CUDA; use GlooWeightTransferEngine on CPU")
        device = (init_info or {}).get("device")
        return IPCSender(torch.device(device) if device is not None else None)

    @classmethod
    def trainer_send_weights(
        cls,
        iterator: Iterable[tuple[str, torch.Tensor]],
        trainer_args: Mapping[str, Any] | None = None,
        *,
        group: IPCSender | None = None,
        url: str | None = None,
        admin_key: str | None = None,
        weight_version: int | None = None,
        send: Callable[[dict[str, Any]], Any] | None = None,
        timeout_s: float = 300.0,
        **ignored: Any,
    ) -> dict[str, Any]:
        """Export (or reuse) handles and have the server copy from them.

        Returns the server's /update_weights answer. The other backends' `packed*`, `checksum` and
        vLLM's `mode`/`send_mode` are accepted, as keywords or in trainer_args, and ignored:
        nothing is packed, the server reads in place.
        """
        args = dict(group=group, url=url, admin_key=admin_key, weight_version=weight_version,
                    send=send, timeout_s=timeout_s)
        given = {**ignored, **(trainer_args or {})}
        unknown = set(given) - set(args) - _IGNORED_ARGS
        if unknown:
            raise TypeError(f"trainer_send_weights: unknown arguments {sorted(unknown)}")
        args.update({k: v for k, v in given.items() if k in args})
        sender = args["group"]
        if not isinstance(sender, IPCSender):
            raise TypeError("group must be the IPCSender returned by IPCWeightTransferEngine.trainer_init")
        info = sender.update_info(iterator, args["weight_version"])
        if args["send"] is not None:
            return args["send"](info)
        if not args["url"]:
            raise TypeError("trainer_send_weights needs url= (the server) or send= (a callable)")
        from .client import post_update
        return post_update(args["url"], info, args["admin_key"], args["timeout_s"])
