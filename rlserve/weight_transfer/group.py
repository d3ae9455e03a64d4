"""A stateless trainer<->server transfer group.

A TCPStore (hosted by the trainer, rank 0) carries the control messages; the bytes move
over NCCL (a process group constructed directly, so torch.distributed's default group,
which the trainer may be training with, is never touched) or, for the CPU backend
"gloo", over framed TCP streams (tcp.py says why not gloo itself). Receivers are ranks
1..N-1.

Every wait is bounded by `timeout_s`, forming the group included: the connect runs on a
helper thread and the caller gives up at the deadline whatever the master does (accepts
and never answers, speaks HTTP, ...), or at once when `abort()` is called from another
thread. After a transport failure the group is marked broken and must be initialised
again; the failing side also writes the failure into the keys its peers wait on next
(store_keys.py), so they fail at once instead of at their timeout.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
import uuid
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rlserve.distributed import abort_process_group

from .address import get_ip, get_open_port, resolve, wait_listening  # noqa: F401 (get_*: re-exported)
from .errors import InvalidUpdateError, WeightTransferError
from .store_keys import BROKEN, POLL_S, RECEIVER_FAILURE_KEY, broken_key, poll_key, store_lost, tell_peers
from .tcp import Frames, TcpHub, TcpLink

DEFAULT_TIMEOUT_S = 120.0
BACKENDS = ("nccl", "gloo")
PROTOCOL = 4  # the control protocol between trainer and receivers (handshake.py)
CONNECT_MARGIN_S = 1.0  # a connect gives up this long after timeout_s at the latest
_SESSION_KEY = "rlserve/session"
_DATA_PORT_KEY = "data_port"

T = TypeVar("T")


def _attached(part: T | None, what: str) -> T:
    """A part the connect made; before it, or once torn down, an error that the caller's
    handler turns into the group's failure."""
    if part is None:
        raise WeightTransferError(f"the group's {what} is closed")
    return part


class TransferGroup:
    """One rank's handle on the group: store, data plane, turn counters (handshake.py)."""

    def __init__(self, backend: str, master_address: str, master_port: int, rank: int,
                 world_size: int, device: torch.device | str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 connect: bool = True):
        if backend not in BACKENDS:
            raise InvalidUpdateError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if not (isinstance(world_size, int) and world_size >= 2):
            raise InvalidUpdateError(f"world_size must be an integer >= 2 (trainer + receivers), got {world_size!r}")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise InvalidUpdateError(f"rank {rank!r} is outside [0, world_size={world_size})")
        if not timeout_s > 0:
            raise InvalidUpdateError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.address, self.port = master_address, int(master_port)
        self.master = f"{master_address}:{master_port}"
        self.device = torch.device(device)
        if backend == "gloo":
            self.device = torch.device("cpu")  # the TCP data plane moves host memory
        self.timeout_s = float(timeout_s)  # may be lowered after init: later calls use it
        # Turns (handshake.py): a receiver's next turn; the trainer's next turn per rank.
        self.turn = 0
        self.turns = {r: 0 for r in range(1, world_size)} if rank == 0 else {}  # a receiver uses `turn`
        self.forgotten: dict[int, int] = {}  # trainer: per rank, turns below this have no keys left
        self.posted_plans: set[str] = set()  # trainer: digests whose plan is in the store (handshake.py)
        self.broken: str | None = None
        self.session = ""
        # What the connect makes (None before it, and once torn down). The NCCL group is Any:
        # torch's stubs give its Backend base class no collectives.
        self.pg: Any = None
        self.hub: TcpHub | None = None
        self.link: TcpLink | None = None
        self._store: dist.Store | None = None
        self._base: dist.TCPStore | None = None
        # CUDA: this group's work never runs on the caller's stream
        self.stream: torch.cuda.Stream | None = None
        self.side_stream: torch.cuda.Stream | None = None
        self.host_ring: list[torch.Tensor] = []  # the trainer's packing buffers in host memory (pipeline.py)
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        if connect:
            self.connect()

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    # --- forming the group ---------------------------------------------------

    def connect(self) -> TransferGroup:
        """Join the group; returns within timeout_s (+ CONNECT_MARGIN_S) or raises."""
        started = time.monotonic()
        box: dict[str, BaseException] = {}

        def run() -> None:
            try:
                self._connect(started + self.timeout_s)
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=run, name=f"rlserve-transfer-connect-r{self.rank}", daemon=True)
        t.start()
        deadline = started + self.timeout_s + CONNECT_MARGIN_S
        while t.is_alive() and time.monotonic() < deadline and not self._cancelled.is_set():
            t.join(0.05)
        error = box.get("error")
        if not t.is_alive() and error is None and not self._cancelled.is_set():
            return self
        # A connect still blocked inside the store or NCCL tears down what it made when
        # it returns (see _keep); nothing waits for it.
        reason = self.broken if self._cancelled.is_set() and self.broken else None
        self._cancelled.set()
        self.broken = self.broken or "its init failed"
        self._teardown()
        self._store = self._base = None  # the trainer's store frees its port
        if error is not None:
            traceback.clear_frames(error.__traceback__)  # nor may the frames in the error keep it
        if isinstance(error, InvalidUpdateError):
            raise error
        hint = ("did every server worker join via /init_weight_transfer_engine?" if self.rank == 0
                else "is the trainer's trainer_init running with the same world_size?")
        why = reason or (str(error) if error is not None else "no answer")
        raise WeightTransferError(
            f"{self.backend} transfer group init failed at {self.master} (rank {self.rank}/{self.world_size}) "
            f"after {time.monotonic() - started:.1f}s (timeout {self.timeout_s:g}s; {hint}): {why}") from error

    def _keep(self, **parts: Any) -> None:
        """Attach what the connect thread made, unless the caller has given up meanwhile."""
        with self._lock:
            for name, value in parts.items():
                setattr(self, name, value)
            cancelled = self._cancelled.is_set()
        if cancelled:
            self._teardown()
            raise WeightTransferError("cancelled")

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0 or self._cancelled.is_set():
            raise WeightTransferError("cancelled" if self._cancelled.is_set() else "timed out")
        return left

    def _connect(self, deadline: float) -> None:
        address, port, trainer = self.address, self.port, self.rank == 0
        if not trainer:
            resolve(address, port, self._left(deadline))
            wait_listening(address, port, deadline, self._cancelled)
        base = dist.TCPStore(address, port, None, trainer, timedelta(seconds=self._left(deadline)),
                             wait_for_workers=False)
        self._keep(_base=base)
        if trainer:
            session = uuid.uuid4().hex[:12]
            base.set(_SESSION_KEY, f"{PROTOCOL}:{session}")
        else:
            base.wait([_SESSION_KEY], timedelta(seconds=self._left(deadline)))
            value = base.get(_SESSION_KEY).decode(errors="replace")
            protocol, _, session = value.rpartition(":")
            if protocol != str(PROTOCOL):
                raise WeightTransferError(
                    f"the trainer speaks weight-transfer protocol {protocol or 1}, this server {PROTOCOL}: "
                    "run the same rlserve version on both sides")
        store = dist.PrefixStore(f"rlserve/{session}/ctl", base)
        self._keep(session=session, _store=store)
        if self.backend == "gloo":
            if trainer:
                hub = TcpHub(self.timeout_s)
                self._keep(hub=hub)
                store.set(_DATA_PORT_KEY, str(hub.port))
                hub.accept(range(1, self.world_size), session, deadline, self._cancelled)
            else:
                store.wait([_DATA_PORT_KEY], timedelta(seconds=self._left(deadline)))
                data_port = int(store.get(_DATA_PORT_KEY))
                self._keep(link=TcpLink(address, data_port, session, self.rank, deadline, self.timeout_s))
        else:
            self._keep(pg=self._make_nccl_pg(dist.PrefixStore(f"rlserve/{session}/pg", base)))
        # One tiny broadcast proves every rank is connected (and makes NCCL build its
        # communicator now instead of inside the first update).
        with self.streams():
            probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
            self.wait(self.broadcast(probe), "the connectivity probe", timeout_s=self._left(deadline))

    def _make_nccl_pg(self, store):
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise WeightTransferError("the nccl backend needs a CUDA build of torch")
        if self.device.type != "cuda":
            raise WeightTransferError(f"the nccl backend needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)
        self.side_stream = torch.cuda.Stream(self.device)
        opts = dist.ProcessGroupNCCL.Options()
        # Our own waits fire first and abort the group; the watchdog is a backstop.
        opts._timeout = timedelta(seconds=self.timeout_s + 60)
        with torch.cuda.device(self.device):
            return dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)

    # --- the data plane ------------------------------------------------------

    def streams(self):
        """NCCL: make this group's stream current, so transfers never wait on (or hold up)
        the work the caller's thread queues on its own stream (the engine's steps)."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start sending (rank 0) or receiving (others) one buffer; pass the result to `wait`.
        NCCL: enqueued on the caller's current stream; gloo: a contiguous CPU uint8 tensor."""
        self.check_usable()
        try:
            if self.backend == "nccl":
                with torch.cuda.device(self.device):
                    return self.pg.broadcast(tensor, src, self.timeout)
            if self.rank == 0:
                return _attached(self.hub, "data hub").send(tensor)
            return _attached(self.link, "data link").recv(tensor)
        except Exception as e:
            raise self.fail(f"broadcast could not start: {e}") from e

    def wait(self, work, what: str, timeout_s: float | None = None) -> None:
        """Block until `work` is through, at most timeout_s (default: the group's) without
        it finishing; a failure, a timeout or a peer's reported failure breaks the group."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            slice_s = min(POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                if isinstance(work, Frames):
                    finished = work.wait(slice_s)
                elif _poll_nccl(work, slice_s):
                    work.wait()  # raises what NCCL reported; orders the current stream after it
                    finished = True
                else:
                    finished = False
            except Exception as e:
                if self._cancelled.is_set():
                    raise self.fail(f"{what}: {self.broken}") from e
                raise self.fail(f"{what} failed after {time.monotonic() - started:.1f}s: {e}") from e
            if finished:
                return
            if self._cancelled.is_set():
                raise self.fail(f"{what}: {self.broken}")
            peer = self.peer_failure()
            if peer is not None:
                raise self.fail(f"{what}: {peer}")
            if time.monotonic() >= deadline:
                raise self.fail(f"{what} timed out after {time.monotonic() - started:.1f}s "
                                 f"(timeout {timeout_s:g}s)")

    # --- control-plane store -------------------------------------------------

    def set(self, key: str, value: str) -> None:
        try:
            _attached(self._store, "store").set(key, value)
        except Exception as e:
            raise self.fail(f"store set {key!r} failed: {e}") from e

    def cas(self, key: str, value: str) -> str:
        """Write `value` unless the key exists; return what the key holds now."""
        try:
            return _attached(self._store, "store").compare_set(key, "", value).decode(errors="replace")
        except Exception as e:
            raise self.fail(f"store compare_set {key!r} failed: {e}") from e

    def await_key(self, key: str, timeout_s: float, what: str) -> str | None:
        """The key's value once it exists, or None after timeout_s. A value saying a peer's
        group broke, or a store that is gone, breaks this group too."""
        self.check_usable()
        started = time.monotonic()
        try:
            store = _attached(self._store, "store")
            if self.rank == 0:
                value = poll_key(store, key, started + timeout_s)
            else:
                store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
                value = store.get(key).decode(errors="replace")
        except dist.DistStoreError:
            return None  # timed out: the caller decides what a no-show means
        except Exception as e:
            if self._cancelled.is_set():
                raise self.fail(f"waiting for {what}: {self.broken}") from e
            if isinstance(e, dist.DistNetworkError):
                raise self.fail(f"waiting for {what} after {time.monotonic() - started:.1f}s: "
                                f"{store_lost(self.master, e)}") from e
            raise self.fail(f"waiting for {what} failed after {time.monotonic() - started:.1f}s: {e}") from e
        if value is None:
            return None
        if value.startswith(BROKEN):
            raise self.fail(f"waiting for {what}: {value[len(BROKEN):]}")
        return value

    def peer_failure(self) -> str | None:
        """A peer's reported failure, if any (one store round trip): the trainer's, for a
        receiver; the first receiver's, for the trainer."""
        failure = RECEIVER_FAILURE_KEY if self.rank == 0 else broken_key(0)
        try:
            store = _attached(self._store, "store")
            if store.check([failure]):
                return store.get(failure).decode(errors="replace")
        except Exception as e:
            return store_lost(self.master, e)
        return None

    def delete(self, key: str) -> None:
        try:
            _attached(self._store, "store").delete_key(key)
        except Exception:
            pass  # housekeeping only

    # --- lifecycle -----------------------------------------------------------

    def check_usable(self) -> None:
        if self.broken is not None:
            raise WeightTransferError(f"transfer group {self.master} is unusable ({self.broken}); "
                                      "initialise the weight transfer again")

    def fail(self, message: str) -> WeightTransferError:
        """Any transport failure desynchronises the peers: poison the group, tell them."""
        message = f"rank {self.rank}/{self.world_size} at {self.master}: {message}"
        first = self.broken is None
        if first:
            self.broken = message
            self._tell_peers(message)
        self._teardown()
        return WeightTransferError(f"{message}; initialise the weight transfer again")

    def _tell_peers(self, message: str) -> None:
        """Best effort: mark this rank broken, and fill the keys the peers wait on next."""
        store = self._store
        if store is None:
            return
        try:
            store.set(broken_key(self.rank), message)
            if self.rank != 0:
                store.compare_set(RECEIVER_FAILURE_KEY, "", f"receiver rank {self.rank}: {message}")
            tell_peers(store, self.rank, self.turn, self.turns, BROKEN + message)
        except Exception:
            pass  # the store is gone: the peers find out from that

    def _teardown(self) -> None:
        with self._lock:
            pg, hub, link = self.pg, self.hub, self.link
            self.pg = self.hub = self.link = None
        abort_process_group(pg)
        for part in (hub, link):
            if part is not None:
                part.close()

    def abort(self, reason: str = "aborted") -> None:
        """From any thread: stop a pending connect or transfer at once (the group is unusable)."""
        self._cancelled.set()
        if self.broken is None:
            self.broken = reason
            self._tell_peers(reason)
        self._teardown()

    def close(self) -> None:
        self.abort("closed")
        self._store = self._base = None
        self.host_ring = []

    def __repr__(self) -> str:
        state = "ok" if self.broken is None else "broken"
        return (f"TransferGroup({self.backend}, {self.master}, rank={self.rank}/{self.world_size}, "
                f"device={self.device}, {state})")


def _poll_nccl(work, timeout_s: float) -> bool:
    """Poll an NCCL work for up to timeout_s (a blocking wait could not be given up on).
    Half a millisecond between polls: under 1% of an 8B push, little CPU while idle."""
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)
    return True

