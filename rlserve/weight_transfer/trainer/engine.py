"""Trainer side: join the group as rank 0 and broadcast weights after the handshake.

handshake.py pairs each push with every receiver's /update_weights and lets a receiver
refuse before any byte moves (the trainer then raises the receiver's message);
pipeline.py packs, checksums and sends the buckets.

Devices: a push goes out from the device its tensors are on. NCCL binds a group to one
GPU, chosen at `trainer_init` (an explicit `device=`, else the current CUDA device), and
a push of tensors on another GPU is refused with a message that says how to fix it;
tensors spread over several devices are refused on every backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidUpdateError
from ..group import DEFAULT_TIMEOUT_S, TransferGroup
from ..handshake import await_done, cancel, post_plan, trainer_handshake
from ..info import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS
from ..packing import (
    TensorMeta,
    plan_buckets,
    plan_digest,
    plan_json,
)
from ..pipeline import send_buckets


def trainer_init(backend: str, init_info: Mapping[str, Any] | Any, device: torch.device | str) -> TransferGroup:
    """Rank 0: host the store at master_address:master_port and wait for every receiver."""
    get: Callable[..., Any] = (init_info.get if isinstance(init_info, Mapping)
                               else lambda k, d=None: getattr(init_info, k, d))
    missing = [k for k in ("master_address", "master_port", "world_size") if get(k) is None]
    if missing:
        raise InvalidUpdateError(f"init_info: missing {', '.join(missing)}")
    return TransferGroup(backend, str(get("master_address")), int(get("master_port")), 0,
                         int(get("world_size")), device, float(get("timeout_s", DEFAULT_TIMEOUT_S)))


def tensors_device(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """The one device all `tensors` are on (None for no tensors); refuses a mix."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"the tensors to send are spread over several devices ({names}): "
                         "move them to one device first")
    return next(iter(devices), None)


def check_source_device(group: TransferGroup, device: torch.device | None) -> None:
    """NCCL sends from the group's GPU only; gloo copies from anywhere to the host."""
    if group.backend != "nccl" or device is None or device == group.device:
        return
    if device.type != "cuda":
        raise ValueError(f"the nccl backend sends CUDA tensors; these are on {device} "
                         "(move them to the GPU, or use the gloo backend)")
    raise ValueError(f"the tensors are on {device}, but this NCCL group was formed on {group.device}: "
                     f"pass device='{device}' to trainer_init (an NCCL group is bound to one GPU)")


def send_weights(
    iterator: Iterable[tuple[str, torch.Tensor]],
    group: TransferGroup,
    packed: bool = False,
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None,
    checksum: bool = True,
) -> None:
    """Broadcast (name, tensor) pairs to every receiver; returns once every receiver has
    them, checked. Raises UpdateRefusedError on a refusal (the receivers' message), and
    WeightTransferError when the transfer fails, a damaged bucket on a receiver included.

    The iterator is materialised first (references only, no copies) because the plan
    needs every name, dtype and shape before the first byte moves. If that fails (or the
    tensors are on the wrong device), the receivers are told, so their /update_weights
    answers at once. `checksum=False` skips the per-bucket checksums (for measuring them).
    """
    group.check_usable()
    try:
        items = list(iterator)
        tensors = [(post_iter_func(item) if post_iter_func else item[1]).detach() for item in items]
        metas = [TensorMeta.of(name, t) for (name, _), t in zip(items, tensors)]
        check_source_device(group, tensors_device(tensors))
    except Exception as e:
        cancel(group, f"{type(e).__name__}: {e}")
        raise
    digest = plan_digest(metas, packed, packed_buffer_size_bytes)
    post_plan(group, digest, lambda: plan_json(metas, packed, packed_buffer_size_bytes))
    turns = trainer_handshake(group, {"digest": digest, "checksum": bool(checksum)})
    buckets = plan_buckets(metas, packed, packed_buffer_size_bytes)
    send_buckets(group, metas, tensors, buckets, int(packed_num_buffers), checksum)
    await_done(group, turns)


@dataclass
class NCCLTrainerSendWeightsArgs:
    """trainer_send_weights' keywords as one value (vLLM's `trainer_args=`); a dict works too."""

    group: TransferGroup | None = None
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None
    src: int = 0
    checksum: bool = True
    stream: Any = None  # vLLM's CUDA stream: accepted, unused (the transfer runs on streams of its own)


@dataclass
class GlooTrainerSendWeightsArgs(NCCLTrainerSendWeightsArgs):
    pass


def trainer_args_dict(trainer_args: Mapping[str, Any] | Any | None) -> dict[str, Any]:
    """`trainer_args` as keywords: a dict, or an args dataclass (its fields, not copies of them)."""
    if trainer_args is None:
        return {}
    if dataclasses.is_dataclass(trainer_args):
        return {f.name: getattr(trainer_args, f.name) for f in dataclasses.fields(trainer_args)}
    if isinstance(trainer_args, Mapping):
        return dict(trainer_args)
    raise TypeError(f"trainer_args: a dict or a TrainerSendWeightsArgs, got {type(trainer_args).__name__}")


class TrainerEngine:
    """Trainer entry points in the style of vLLM's RLHF-over-HTTP example; subclasses pick the backend and device."""

    backend = ""

    @classmethod
    def device(cls, device: torch.device | str | None = None) -> torch.device:
        raise NotImplementedError

    @classmethod
    def trainer_init(cls, init_info: Mapping[str, Any] | Any, device: torch.device | str | None = None
                     ) -> TransferGroup:
        """`init_info`: master_address, master_port, world_size, optional timeout_s and device.
        `device`: where the tensors to send will be (NCCL binds the group to that GPU)."""
        if device is None and isinstance(init_info, Mapping):
            device = init_info.get("device")
        return trainer_init(cls.backend, init_info, cls.device(device))

    @classmethod
    def trainer_send_weights(
        cls,
        iterator: Iterable[tuple[str, torch.Tensor]],
        trainer_args: Mapping[str, Any] | NCCLTrainerSendWeightsArgs | None = None,
        *,
        group: TransferGroup | None = None,
        packed: bool = False,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
        post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None,
        src: int = 0,
        checksum: bool = True,
    ) -> None:
        """Keywords as in vLLM's RLHF-over-HTTP example; `trainer_args` (a dict of the same keywords, or an args
        dataclass, as vLLM's examples pass) also works."""
        kwargs: dict[str, Any] = dict(
            group=group, packed=packed, packed_buffer_size_bytes=packed_buffer_size_bytes,
            packed_num_buffers=packed_num_buffers, post_iter_func=post_iter_func, src=src, checksum=checksum)
        given = trainer_args_dict(trainer_args)
        given.pop("stream", None)
        kwargs.update(given)
        if kwargs.pop("src") != 0:
            raise ValueError("the trainer is always rank 0 of the transfer group (src=0)")
        if not isinstance(kwargs["group"], TransferGroup):
            raise TypeError("group must be the TransferGroup returned by trainer_init")
        if kwargs["group"].backend != cls.backend:
            raise ValueError(f"group uses {kwargs['group'].backend}, not {cls.backend}")
        send_weights(iterator, **kwargs)
