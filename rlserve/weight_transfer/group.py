"""A stateless trainer<->server transfer group.

Built from a TCPStore and a process group constructed directly, so it never
touches torch.distributed's default group (the trainer may be using that one to
train). Rank 0 is the trainer and hosts the store; receivers are ranks 1..N-1.
Every blocking call is bounded by `timeout_s` and fails with
`WeightTransferError`; after a transport failure the group is marked broken and
must be initialised again (same or new port).
"""

from __future__ import annotations

import socket
import time
import uuid
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from rlserve.distributed import abort_process_group

from .errors import InvalidUpdateError, WeightTransferError

DEFAULT_TIMEOUT_S = 120.0
BACKENDS = ("nccl", "gloo")
_SESSION_KEY = "rlserve/session"


def get_ip() -> str:
    """This host's outbound IP address (no packet is sent), else 127.0.0.1."""
    return _local_ip_towards("8.8.8.8")


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _local_ip_towards(address: str) -> str:
    # Connecting a UDP socket only picks the route; it sends nothing.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 80))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _wait_listening(address: str, port: int, deadline: float) -> None:
    """Poll until the master accepts connections: TCPStore's own connect retries
    can overrun their timeout severalfold when nobody listens yet."""
    while True:
        try:
            with socket.create_connection((address, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise WeightTransferError(f"nothing accepts connections at {address}:{port} "
                                          f"(is the trainer's trainer_init running?): {e}") from e
            time.sleep(0.1)


class TransferGroup:
    """One rank's handle on the group: store, process group, update counter."""

    def __init__(self, backend: str, master_address: str, master_port: int, rank: int,
                 world_size: int, device: torch.device | str, timeout_s: float = DEFAULT_TIMEOUT_S):
        if backend not in BACKENDS:
            raise InvalidUpdateError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if not (isinstance(world_size, int) and world_size >= 2):
            raise InvalidUpdateError(f"world_size must be an integer >= 2 (trainer + receivers), got {world_size!r}")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise InvalidUpdateError(f"rank {rank!r} is outside [0, world_size={world_size})")
        if not timeout_s > 0:
            raise InvalidUpdateError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.master = f"{master_address}:{master_port}"
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)  # may be lowered after init: later calls use it
        self.seq = 0  # updates attempted on this group; both sides count in lockstep
        self.broken: str | None = None
        self.pg = self._store = None
        started = time.monotonic()
        try:
            if rank != 0:
                _wait_listening(master_address, int(master_port), started + self.timeout_s)
            base = dist.TCPStore(master_address, int(master_port), None, rank == 0, self.timeout,
                                 wait_for_workers=False)
            # A fresh session id per trainer_init keeps keys of distinct inits apart.
            if rank == 0:
                self.session = uuid.uuid4().hex[:12]
                base.set(_SESSION_KEY, self.session)
            else:
                base.wait([_SESSION_KEY], self.timeout)
                self.session = base.get(_SESSION_KEY).decode()
            self._store = dist.PrefixStore(f"rlserve/{self.session}/ctl", base)
            pg_store = dist.PrefixStore(f"rlserve/{self.session}/pg", base)
            self.pg = self._make_pg(pg_store, master_address)
            # One tiny broadcast proves every rank is connected (and makes NCCL
            # build its communicator now instead of inside the first update).
            probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
            self.wait(self.broadcast(probe), "the connectivity probe")
        except Exception as e:  # store/pg constructors raise assorted RuntimeErrors
            self.close()
            hint = ("did every server worker join via /init_weight_transfer_engine?" if rank == 0
                    else "is the trainer's trainer_init running with the same world_size?")
            raise WeightTransferError(
                f"{backend} transfer group init failed at {self.master} (rank {rank}/{world_size}) "
                f"after {time.monotonic() - started:.1f}s (timeout {self.timeout_s:g}s; {hint}): {e}") from e

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def _make_pg(self, store, master_address: str):
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            # Bind to the interface that reaches the master: the default device
            # resolves the hostname, which is often 127.0.1.1 on Debian hosts.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_ip_towards(master_address))]
            return dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise WeightTransferError("the nccl backend needs a CUDA build of torch")
        if self.device.type != "cuda":
            raise WeightTransferError(f"the nccl backend needs a CUDA device, got {self.device}")
        opts = dist.ProcessGroupNCCL.Options()
        # Our own waits fire first and abort the group; the watchdog is a backstop.
        opts._timeout = timedelta(seconds=self.timeout_s + 60)
        return dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)

    # --- collectives -------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start an async broadcast; pass the result to `wait`."""
        self.check_usable()
        try:
            return self.pg.broadcast(tensor, src, self.timeout)
        except Exception as e:
            raise self._fail(f"broadcast could not start: {e}") from e

    def wait(self, work, what: str, started: float | None = None) -> None:
        started = time.monotonic() if started is None else started
        try:
            work.wait(self.timeout)
        except Exception as e:
            raise self._fail(f"{what} failed after {time.monotonic() - started:.1f}s "
                             f"(timeout {self.timeout_s:g}s): {e}") from e

    # --- control-plane store -----------------------------------------------

    def set(self, key: str, value: str) -> None:
        try:
            self._store.set(key, value)
        except Exception as e:
            raise self._fail(f"store set {key!r} failed: {e}") from e

    def get(self, key: str, what: str) -> str:
        """Wait (bounded) for `key` and return its value."""
        started = time.monotonic()
        try:
            self._store.wait([key], self.timeout)
            return self._store.get(key).decode()
        except Exception as e:
            raise self._fail(f"waiting for {what} failed after {time.monotonic() - started:.1f}s "
                             f"(timeout {self.timeout_s:g}s): {e}") from e

    def delete(self, key: str) -> None:
        try:
            self._store.delete_key(key)
        except Exception:
            pass  # housekeeping only

    # --- lifecycle ---------------------------------------------------------

    def next_seq(self) -> int:
        self.check_usable()
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def check_usable(self) -> None:
        if self.broken is not None:
            raise WeightTransferError(f"transfer group {self.master} is unusable after an earlier failure "
                                      f"({self.broken}); initialise the weight transfer again")

    def _fail(self, message: str) -> WeightTransferError:
        # Any transport failure desynchronises the peers: poison the group.
        message = f"rank {self.rank}/{self.world_size} at {self.master}: {message}"
        if self.broken is None:
            self.broken = message
        self._abort()
        return WeightTransferError(message)

    def _abort(self) -> None:
        pg, self.pg = self.pg, None
        abort_process_group(pg)

    def close(self) -> None:
        if self.broken is None:
            self.broken = "closed"
        self._abort()
        self._store = None

    def __repr__(self) -> str:
        state = "ok" if self.broken is None else "broken"
        return (f"TransferGroup({self.backend}, {self.master}, rank={self.rank}/{self.world_size}, "
                f"device={self.device}, seq={self.seq}, {state})")


def broadcast_buckets(group: TransferGroup, buckets, depth: int, get_buffer, on_done=None) -> None:
    """Broadcast every non-empty bucket in order, keeping up to `depth` in flight.

    `get_buffer(i, bucket)` returns the uint8 tensor for bucket i (filled on the
    sender, to be filled on receivers). It is called only once bucket i-depth
    has completed, so a ring of `depth` buffers can be reused safely.
    `on_done(i, bucket, buffer)` runs when bucket i has arrived.
    """
    started = time.monotonic()
    total = len(buckets)
    inflight: deque = deque()

    def finish() -> None:
        i, bucket, buf, work = inflight.popleft()
        group.wait(work, f"bucket {i + 1}/{total} ({bucket.nbytes} bytes, {len(bucket.slots)} tensors)", started)
        if on_done is not None:
            on_done(i, bucket, buf)

    for i, bucket in enumerate(buckets):
        if bucket.nbytes == 0:
            continue  # nothing on the wire; both sides skip it
        while len(inflight) >= max(1, depth):
            finish()
        buf = get_buffer(i, bucket)
        inflight.append((i, bucket, buf, group.broadcast(buf)))
    while inflight:
        finish()
