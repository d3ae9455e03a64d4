"""Moving a plan's buckets over the data plane, overlapped, with checksums.

Trainer: bucket k+1 is packed (into one of `depth` ring buffers) while bucket k is on
the wire, and each bucket is checksummed while it is being sent. On CUDA packing and
checksums run on the group's side stream and the broadcasts on its main stream, ordered
by events only: the host queues the whole push without waiting for the device, and
checks completion at the end. On CPU (the TCP data plane) the sends run on one thread
per receiver while this thread packs and checksums.

Receiver: a bucket whose tensors arrive in their staging dtype is received into a buffer
of its own and handed out as views (no unpack copy); one that needs a cast goes through
a ring of two buffers. Each bucket is checksummed as soon as it has arrived (side stream
on CUDA, this thread on CPU while the next one arrives), and the trainer's checksums,
sent last, are compared before anything is returned: a short, long or altered bucket
fails the update and is named, with its tensors.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from .checksum import checksum_into
from .errors import WeightTransferError
from .group import TransferGroup
from .packing import Bucket, TensorMeta, as_bytes, ring_buffer_bytes

_NAMES_SHOWN = 4


def describe(k: int, n: int, bucket: Bucket, metas: Sequence[TensorMeta]) -> str:
    names = [metas[s.index].name for s in bucket.slots]
    more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    shown = ", ".join(names[:_NAMES_SHOWN]) + more
    return f"bucket {k + 1}/{n} ({bucket.nbytes} bytes: {shown})"


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src (uint8). Host to host in numpy: one thread, GIL released; torch's parallel
    copy contends with the engine's (and other processes') threads, 20x slower when busy."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src, non_blocking=dst.device.type == "cuda")


class _Lanes:
    """Where per-bucket work runs. CUDA: the group's side stream, ordered against its main
    stream (current inside `group.streams()`) by events. CPU: inline."""

    def __init__(self, group: TransferGroup):
        self.group = group
        self.side = group.side_stream

    def side_work(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def main_waits_side(self) -> None:
        if self.side is not None:
            torch.cuda.current_stream(self.group.device).wait_stream(self.side)

    def side_waits(self, work, what: str) -> None:
        """The side stream (CUDA) or this thread (CPU) waits until `work` has arrived."""
        if self.side is None:
            self.group.wait(work, what)
            return
        work.wait()  # the main stream waits for the broadcast: no host round trip
        self.side.wait_stream(torch.cuda.current_stream(self.group.device))

    def mark(self):
        """A point on the side stream that a later step can wait for."""
        return self.side.record_event() if self.side is not None else None


def send_buckets(group: TransferGroup, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor],
                 buckets: Sequence[Bucket], depth: int, checksum: bool) -> None:
    """Broadcast every non-empty bucket (then the checksums) and wait until all went out."""
    with _failing_breaks(group):
        _send_buckets(group, metas, tensors, buckets, depth, checksum)


def receive_buckets(group: TransferGroup, metas: Sequence[TensorMeta], buckets: Sequence[Bucket],
                    staging: Sequence[torch.dtype], device: torch.device, checksum: bool
                    ) -> list[tuple[str, torch.Tensor]]:
    """Receive every non-empty bucket into staging tensors on `device` and verify it."""
    with _failing_breaks(group):
        return _receive_buckets(group, metas, buckets, staging, device, checksum)


@contextlib.contextmanager
def _failing_breaks(group: TransferGroup):
    """Whatever fails mid-transfer leaves queued collectives behind: abort them (their
    watchdog would end the process otherwise) and tell the peers."""
    try:
        yield
    except WeightTransferError:
        raise
    except Exception as e:
        raise group.fail(f"{type(e).__name__}: {e}") from e
    except BaseException:  # KeyboardInterrupt and the like: stop the transfer, keep the exception
        group.fail("interrupted")
        raise


def _ring(group: TransferGroup, nbytes: int, count: int) -> list[torch.Tensor]:
    """The trainer's packing buffers. Host memory is kept on the group from one push to the
    next: fresh pages cost a fault each (a 512 MiB buffer, ~0.2 s). CUDA's caching allocator
    already reuses its blocks, and the trainer gets them back between pushes."""
    if group.device.type != "cpu":
        return [torch.empty(nbytes, dtype=torch.uint8, device=group.device) for _ in range(count)]
    kept = group.host_ring
    if len(kept) < count or any(b.numel() < nbytes for b in kept[:count]):
        kept[:] = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(count)]
    return [b[:nbytes] for b in kept[:count]]


def _send_buckets(group: TransferGroup, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor],
                  buckets: Sequence[Bucket], depth: int, checksum: bool) -> None:
    live = [b for b in buckets if b.nbytes]
    if not live:
        return
    lanes, dev = _Lanes(group), group.device
    caller = torch.cuda.current_stream(dev) if lanes.side is not None else None
    packed = [b for b in live if not b.direct]
    ring_size = min(max(1, depth), len(packed))
    sent: list[tuple[object, str, torch.Tensor]] = []  # work, what, buffer (kept alive until done)
    free: list = [None] * ring_size  # per ring slot: what marks its last send as finished
    used = 0
    cuda = lanes.side is not None
    with torch.no_grad(), group.streams():
        if lanes.side is not None and caller is not None:  # the tensors were written on the caller's stream
            lanes.side.wait_stream(caller)
            torch.cuda.current_stream(dev).wait_stream(caller)
        ring = _ring(group, ring_buffer_bytes(live), ring_size)
        sums = torch.empty(len(live), dtype=torch.int64, device=dev)  # every entry is written
        for k, bucket in enumerate(live):
            slot = None
            with lanes.side_work():
                if bucket.direct:
                    buf = as_bytes(tensors[bucket.slots[0].index].to(dev))
                else:
                    slot, used = used % ring_size, used + 1
                    if free[slot] is not None:
                        if lanes.side is not None:  # CUDA
                            lanes.side.wait_event(free[slot])
                        else:
                            group.wait(free[slot], "sending an earlier bucket")
                    buf = ring[slot][: bucket.nbytes]
                    for s in bucket.slots:
                        if s.nbytes:
                            _copy_bytes(buf[s.offset: s.offset + s.nbytes], as_bytes(tensors[s.index]))
                ready = lanes.mark()
            if ready is not None:
                torch.cuda.current_stream(dev).wait_event(ready)
            work = group.broadcast(buf)
            if checksum:  # reads the buffer while the broadcast does (the side stream's order
                with lanes.side_work():  # keeps the next packing into it behind this)
                    checksum_into(buf, sums[k])
            if cuda:
                work.wait()  # the main stream waits for the send: the slot's buffer is free after it
                if slot is not None:
                    free[slot] = torch.cuda.current_stream(dev).record_event()
            elif slot is not None:
                free[slot] = work
            sent.append((work, describe(k, len(live), bucket, metas), buf))
        if checksum:
            lanes.main_waits_side()
            sent.append((group.broadcast(sums.view(torch.uint8)), "the bucket checksums", sums))
        for work, what, _ in sent:
            group.wait(work, what)


def _receive_buckets(group: TransferGroup, metas: Sequence[TensorMeta], buckets: Sequence[Bucket],
                     staging: Sequence[torch.dtype], device: torch.device, checksum: bool
                     ) -> list[tuple[str, torch.Tensor]]:
    live = [b for b in buckets if b.nbytes]
    works: list[tuple[object, str]] = []
    pending: deque = deque()
    with torch.no_grad(), group.streams():
        rx = _Unpacker(group, metas, live, staging, device, checksum)
        for k, bucket in enumerate(live):
            buf, slot = rx.buffer(bucket)
            work = group.broadcast(buf)
            works.append((work, describe(k, len(live), bucket, metas)))
            pending.append((k, bucket, buf, work, slot))
            # CPU: unpack bucket k while bucket k+1 arrives; CUDA: queue it all now.
            while len(pending) > (1 if rx.lanes.side is None else 0):
                rx.unpack(*pending.popleft())
        while pending:
            rx.unpack(*pending.popleft())
        if checksum and live:
            works.append((group.broadcast(rx.theirs.view(torch.uint8)), "the bucket checksums"))
        for work, what in works:
            group.wait(work, what)
        if rx.lanes.side is not None:
            rx.lanes.side.synchronize()
        bad = (rx.mine != rx.theirs).nonzero().flatten().tolist() if checksum and live else []
    if bad:
        first = describe(bad[0], len(live), live[bad[0]], metas)
        more = f" (and {len(bad) - 1} more bucket(s))" if len(bad) > 1 else ""
        raise group.fail(f"{first} does not match the trainer's checksum{more}: it arrived short, "
                          "long or altered; nothing was applied")
    return rx.tensors()


class _Unpacker:
    """The receiving side's buffers and unpacking: a bucket whose tensors keep their dtype
    on the group's device gets a buffer of its own, handed out as views; the others go
    through a ring of two buffers and are cast into staging tensors. Made inside
    `group.streams()`: its buffers are allocated on the group's stream, and nothing queues
    behind the caller's work."""

    def __init__(self, group: TransferGroup, metas: Sequence[TensorMeta], live: Sequence[Bucket],
                 staging: Sequence[torch.dtype], device: torch.device, checksum: bool):
        self.group, self.metas, self.live, self.staging = group, metas, live, staging
        self.device, self.checksum = device, checksum
        self.lanes = _Lanes(group)
        self.out: list[torch.Tensor | None] = [None] * len(metas)
        self.free: list = [None, None]  # per ring slot: what marks its last unpack as done
        self.used = 0
        casts = [b for b in live if not b.direct and not self.as_views(b)]
        dev = group.device
        self.ring = [torch.empty(ring_buffer_bytes(casts), dtype=torch.uint8, device=dev)
                     for _ in range(2 if casts else 0)]
        self.mine = torch.empty(len(live), dtype=torch.int64, device=dev)  # every entry is written
        self.theirs = torch.empty(len(live), dtype=torch.int64, device=dev)

    def as_views(self, bucket: Bucket) -> bool:
        return self.device == self.group.device and all(
            self.staging[s.index] == self.metas[s.index].dtype for s in bucket.slots)

    def buffer(self, bucket: Bucket) -> tuple[torch.Tensor, int | None]:
        """Where `bucket` arrives, and its ring slot (None: a buffer of its own)."""
        dev = self.group.device
        if bucket.direct or self.as_views(bucket):
            return torch.empty(bucket.nbytes, dtype=torch.uint8, device=dev), None
        slot, self.used = self.used % 2, self.used + 1
        if self.free[slot] is not None:  # CPU unpacks inline: nothing to wait for
            torch.cuda.current_stream(dev).wait_event(self.free[slot])
        return self.ring[slot][: bucket.nbytes], slot

    def unpack(self, k: int, bucket: Bucket, buf: torch.Tensor, work, slot: int | None) -> None:
        lanes, metas = self.lanes, self.metas
        lanes.side_waits(work, describe(k, len(self.live), bucket, metas))
        with lanes.side_work():
            if self.checksum:
                checksum_into(buf, self.mine[k])
            views = self.as_views(bucket)
            for s in bucket.slots:
                m = metas[s.index]
                src = buf[s.offset: s.offset + s.nbytes].view(m.dtype).view(m.shape)
                self.out[s.index] = src if views else src.to(device=self.device, dtype=self.staging[s.index],
                                                             copy=True)
            if slot is not None:
                self.free[slot] = lanes.mark()
            elif not views and lanes.side is not None:
                buf.record_stream(lanes.side)  # freed after the receive; the cast reads it first

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        # Zero-byte tensors never travel.
        return [(m.name, t if t is not None else torch.empty(m.shape, dtype=self.staging[k], device=self.device))
                for k, (m, t) in enumerate(zip(self.metas, self.out))]
