"""CUDA IPC, the server's side: open the trainer's handles (ipc.py has the wire format) once
and keep them open between updates."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import torch

from ..errors import InvalidUpdateError
from ..info import UpdateInfo
from ..ipc import IPCHandles, device_uuid, view_of
from ..packing import TensorMeta, tensor_metas
from .receiver import check_against_model


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
        # document (or a reference to it), which then needs no opening or checking again.
        self._last: tuple[UpdateInfo, list, list[TensorMeta], tuple] | None = None

    def receive(self, info: UpdateInfo, expected: Mapping[str, Any],
                validate: Callable[[Sequence[TensorMeta]], None] | None = None
                ) -> list[tuple[str, torch.Tensor]]:
        """Check the update (the NCCL fields + ipc_handles) against the model (and with
        `validate`, as receiver.receive_weights does) and open it."""
        if info.is_reference:
            return self._reference(info, expected, validate)
        body = msgspec.structs.replace(info, weight_version=None)
        if self._last is not None and self._last[0] == body:
            return self._vetted(expected, validate)
        metas = tensor_metas(info)
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

    def _reference(self, info: UpdateInfo, expected: Mapping[str, Any],
                   validate: Callable | None) -> list[tuple[str, torch.Tensor]]:
        """The views of the last accepted document, which `handles.same_as` names (its
        form, alone and without tensor lists, was checked with the rest of update_info)."""
        same_as = info.ipc_handles["same_as"]
        last_id = None if self._last is None else self._last[0].ipc_handles.get("id")
        if last_id is None or same_as != last_id:
            raise InvalidUpdateError(
                f"update_info.ipc_handles.same_as: this server holds no document {same_as!r} (it restarted, "
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
