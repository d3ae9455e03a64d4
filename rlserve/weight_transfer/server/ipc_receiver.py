"""CUDA IPC, the server's side: open the trainer's handles (ipc.py has the wire format) once
and keep them open between updates."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import InvalidUpdateError
from ..ipc import IPCHandles, device_uuid, is_reference, view_of
from ..packing import TensorMeta
from .receiver import UpdateInfo, check_against_model


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
        """Validate update_info (the NCCL fields + ipc_handles) against the model (and with
        `validate`, as receiver.receive_weights does) and open it."""
        if not isinstance(update_info, Mapping):
            raise InvalidUpdateError("update_info must be a JSON object")
        if is_reference(update_info):
            return self._reference(update_info, expected, validate)
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
        assert self._last is not None  # the callers found an accepted document
        body, views, metas, (last_expected, last_validate) = self._last
        if expected is not last_expected or validate is not last_validate:
            check_against_model(metas, expected)
            if validate is not None:
                validate(metas)
            self._last = (body, views, metas, (expected, validate))
        return views

    def _reference(self, update_info: Mapping[str, Any], expected: Mapping[str, Any],
                   validate: Callable | None) -> list[tuple[str, torch.Tensor]]:
        """The views of the last accepted document, which `handles.same_as` names."""
        where = "update_info.ipc_handles"
        handles = update_info["ipc_handles"]
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
