"""CUDA IPC, the trainer's side: export the parameters' storages once (ipc.py has the wire
format) and post /update_weights with the handles."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ipc import SharedStorage, SharedTensor, device_uuid
from ..packing import dtype_name
from .engine import trainer_args_dict
from .http_client import post_update


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
        """The /update_weights payload for these tensors (the NCCL fields + ipc_handles).

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
            assert ch.doc is not None  # built with the signature
            info = {**ch.doc, "ipc_handles": {**ch.doc["ipc_handles"], "id": ch.doc_id}}
        if weight_version is not None:
            info["weight_version"] = weight_version
        return info

    def _build(self, ch: _Channel, named: list[tuple[str, torch.Tensor]]) -> None:
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
            tensors.append(SharedTensor(index[ptr], int(t.storage_offset()), tuple(t.stride())).to_json())
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


def _export(storage: torch.UntypedStorage) -> SharedStorage:
    (_device, handle, size, offset, counter, counter_offset, event,
     sync) = storage._share_cuda_()
    return SharedStorage(bytes(handle), int(size), int(offset), bytes(counter), int(counter_offset),
                         bytes(event or b""), bool(sync))


_IGNORED_ARGS = frozenset({"mode", "send_mode", "packed", "packed_buffer_size_bytes", "packed_num_buffers",
                           "checksum"})


@dataclass
class IPCTrainerSendWeightsArgs:
    """IPC's trainer_send_weights keywords as one value (vLLM's `trainer_args=`)."""

    group: IPCSender | None = None
    url: str | None = None
    admin_key: str | None = None
    weight_version: int | None = None
    send: Callable[[dict[str, Any]], Any] | None = None
    timeout_s: float = 300.0


class IPCWeightTransferEngine:
    """Trainer entry points in the style of vLLM's RLHF-over-HTTP example for the ipc backend.

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
        trainer_args: Mapping[str, Any] | IPCTrainerSendWeightsArgs | None = None,
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
        args: dict[str, Any] = dict(group=group, url=url, admin_key=admin_key, weight_version=weight_version,
                    send=send, timeout_s=timeout_s)
        given = {**ignored, **trainer_args_dict(trainer_args)}
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
        return post_update(args["url"], info, args["admin_key"], args["timeout_s"])
