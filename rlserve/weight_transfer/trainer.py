"""Trainer side: join the group as rank 0 and broadcast weights after the handshake.

Handshake for update `seq` (a per-group counter both sides keep in lockstep;
keys live in the group's store namespace):

1. trainer  -> `update/{seq}/plan`          {"digest", "plan": plan_json(...)}
2. receiver -> `update/{seq}/verdict/{rank}` {"ok": true} | {"ok": false, "error": msg}
   (a receiver may refuse before the plan arrives, e.g. unknown names)
3. trainer  -> `update/{seq}/go`            {"ok": true} | {"ok": false, "error": msg}
   so a receiver that said ok does not wait for bytes another rank refused.
4. only if every verdict was ok: the buckets are broadcast.

A refusal therefore fails on every side before any byte moves, and leaves the
group usable for the next update.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .errors import InvalidUpdateError, UpdateRefusedError
from .group import DEFAULT_TIMEOUT_S, TransferGroup, broadcast_buckets
from .packing import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    TensorMeta,
    as_bytes,
    plan_buckets,
    plan_digest,
    plan_json,
    ring_buffer_bytes,
)


def update_key(seq: int, what: str) -> str:
    return f"update/{seq}/{what}"


def trainer_init(backend: str, init_info: Mapping[str, Any] | Any, device: torch.device | str) -> TransferGroup:
    """Rank 0: host the store at master_address:master_port and wait for every receiver."""
    get = init_info.get if isinstance(init_info, Mapping) else lambda k, d=None: getattr(init_info, k, d)
    missing = [k for k in ("master_address", "master_port", "world_size") if get(k) is None]
    if missing:
        raise InvalidUpdateError(f"init_info: missing {', '.join(missing)}")
    return TransferGroup(backend, str(get("master_address")), int(get("master_port")), 0,
                         int(get("world_size")), device, float(get("timeout_s", DEFAULT_TIMEOUT_S)))


def send_weights(
    iterator: Iterable[tuple[str, torch.Tensor]],
    group: TransferGroup,
    packed: bool = False,
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None,
) -> None:
    """Broadcast (name, tensor) pairs to every receiver; raises UpdateRefusedError on refusal.

    The iterator is materialised first (references only, no copies) because the
    plan needs every name, dtype and shape before the first byte moves.
    """
    group.check_usable()
    items = list(iterator)
    tensors = [(post_iter_func(item) if post_iter_func else item[1]).detach() for item in items]
    metas = [TensorMeta.of(name, t) for (name, _), t in zip(items, tensors)]
    # Take the turn only now: if the iterator raised, the receiver's pending
    # call still pairs with this trainer's next attempt.
    seq = group.next_seq()

    group.set(update_key(seq, "plan"), json.dumps({
        "digest": plan_digest(metas, packed, packed_buffer_size_bytes),
        "plan": plan_json(metas, packed, packed_buffer_size_bytes),
    }))
    errors: list[str] = []
    for rank in range(1, group.world_size):
        verdict = json.loads(group.get(update_key(seq, f"verdict/{rank}"),
                                       f"the verdict of receiver rank {rank} (is its /update_weights call running?)"))
        if not verdict.get("ok") and verdict.get("error") not in errors:
            errors.append(str(verdict.get("error")))
    if seq > 0:
        _forget(group, seq - 1)  # each receiver finished update seq-1 before voting on this one
    message = "; ".join(errors)
    group.set(update_key(seq, "go"), json.dumps({"ok": not errors, "error": message}))
    if errors:
        raise UpdateRefusedError(message)

    buckets = plan_buckets(metas, packed, packed_buffer_size_bytes)
    depth = max(1, int(packed_num_buffers))
    n_ring = min(depth, sum(1 for b in buckets if not b.direct and b.nbytes))
    ring_bytes = ring_buffer_bytes(buckets)
    ring = [torch.empty(ring_bytes, dtype=torch.uint8, device=group.device) for _ in range(n_ring)]
    used = 0

    def get_buffer(i: int, bucket) -> torch.Tensor:
        nonlocal used
        if bucket.direct:
            return as_bytes(tensors[bucket.slots[0].index].to(group.device))
        buf = ring[used % n_ring][: bucket.nbytes]
        used += 1
        for s in bucket.slots:
            if s.nbytes:
                buf[s.offset : s.offset + s.nbytes].copy_(as_bytes(tensors[s.index]))
        return buf

    with torch.no_grad():
        broadcast_buckets(group, buckets, depth, get_buffer)


def _forget(group: TransferGroup, seq: int) -> None:
    for what in ["plan", "go"] + [f"verdict/{r}" for r in range(1, group.world_size)]:
        group.delete(update_key(seq, what))


class TrainerEngine:
    """Seed-style trainer entry points; subclasses pick the backend and device."""

    backend = ""

    @classmethod
    def device(cls) -> torch.device:
        raise NotImplementedError

    @classmethod
    def trainer_init(cls, init_info: Mapping[str, Any] | Any) -> TransferGroup:
        """`init_info`: master_address, master_port, world_size, optional timeout_s."""
        return trainer_init(cls.backend, init_info, cls.device())

    @classmethod
    def trainer_send_weights(
        cls,
        iterator: Iterable[tuple[str, torch.Tensor]],
        trainer_args: Mapping[str, Any] | None = None,
        *,
        group: TransferGroup | None = None,
        packed: bool = False,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
        post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None,
        src: int = 0,
    ) -> None:
        """Keywords as in the seed; `trainer_args` (a dict of the same keywords) also works."""
        kwargs = dict(group=group, packed=packed, packed_buffer_size_bytes=packed_buffer_size_bytes,
                      packed_num_buffers=packed_num_buffers, post_iter_func=post_iter_func, src=src)
        if trainer_args is not None:
            kwargs.update(trainer_args)
        if kwargs.pop("src") != 0:
            raise ValueError("the trainer is always rank 0 of the transfer group (src=0)")
        if not isinstance(kwargs["group"], TransferGroup):
            raise TypeError("group must be the TransferGroup returned by trainer_init")
        if kwargs["group"].backend != cls.backend:
            raise ValueError(f"group uses {kwargs['group'].backend}, not {cls.backend}")
        send_weights(iterator, **kwargs)
