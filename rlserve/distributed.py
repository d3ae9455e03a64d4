"""The tensor-parallel group of one engine, and how work is split across its ranks.

The group is built from a TCPStore and a process group constructed directly (as the
weight-transfer group is), so it never touches torch.distributed's default group: a
colocated trainer may own that one. Gloo on CPU, NCCL on CUDA.

Parallel layers pick the group up when they are constructed, from `tp_group_scope`, the
way tensors pick up a default device; outside any scope the group is a single rank and
the layers do no communication.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

# A step's collectives wait only for peers running the same step, so this is a backstop
# for a hung peer; a peer that exits fails them at once (gloo) or via abort (NCCL).
DEFAULT_TIMEOUT_S = 600.0


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `total` items are cut into `parts` contiguous
    runs whose sizes differ by at most one, the larger ones first."""
    base, extra = divmod(total, parts)
    size = base + (1 if index < extra else 0)
    start = index * base + min(index, extra)
    return start, size


class HeadShard(NamedTuple):
    """The attention heads one rank owns: query heads [q_start, q_start + num_q) and the
    KV heads [kv_start, kv_start + num_kv) they read."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def partition_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """Split attention heads across ranks; every rank's query heads use only its KV heads.

    With no more ranks than KV heads, each rank takes a contiguous run of KV heads (runs
    may differ by one, e.g. 3 KV heads on 2 ranks: 2 + 1) with their query groups. With
    more ranks than KV heads, each KV head is replicated on world_size / num_kv_heads
    ranks, which split its query group.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of "
                         f"num_key_value_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    if world_size <= num_kv_heads:
        kv_start, num_kv = split_evenly(num_kv_heads, world_size, rank)
        return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    replicas = world_size // num_kv_heads
    if world_size % num_kv_heads or group < replicas:
        raise ValueError(
            f"tensor_parallel_size {world_size} cannot split {num_heads} query heads over "
            f"{num_kv_heads} KV heads: use at most {num_kv_heads} ranks, or a multiple of "
            f"{num_kv_heads} up to {num_heads}")
    kv = rank // replicas
    q_offset, num_q = split_evenly(group, replicas, rank % replicas)
    return HeadShard(kv * group + q_offset, num_q, kv, 1)


def tp_device(device: str, rank: int) -> str:
    """Rank r of an engine on `cuda:k` runs on cuda:k+r; CPU ranks share the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return str(dev)
    return f"cuda:{(dev.index or 0) + rank}"


def host_store(timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free local port (`store.port`)."""
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def abort_process_group(pg) -> None:
    """Best effort: fail collectives pending on this rank (NCCL honours it; gloo fails
    them by itself when a peer's connection closes)."""
    if pg is None:
        return
    for method in ("abort", "shutdown"):
        try:
            getattr(pg, method)()
            return
        except Exception:
            continue


class TPGroup:
    """One rank's handle on the tensor-parallel group."""

    def __init__(self, rank: int = 0, world_size: int = 1, pg=None, device: torch.device | None = None):
        self.rank, self.world_size, self.pg = rank, world_size, pg
        self.device = device or torch.device("cpu")

    @classmethod
    def join(cls, rank: int, world_size: int, device: str | torch.device, port: int,
             store: dist.TCPStore | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
        """Join the group whose store listens on 127.0.0.1:`port` (rank 0 passes the store
        it hosts); blocks until every rank has joined."""
        device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        if world_size == 1:
            return cls(0, 1, None, device)
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, None, False, timeout)
        prefixed = dist.PrefixStore("rlserve/tp", store)
        pg: dist.ProcessGroupNCCL | dist.ProcessGroupGloo
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            # The gloo options class is private in torch's bindings and absent from its stubs.
            gloo_opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            gloo_opts._timeout = timeout
            # Every rank is on this host: loopback, whatever the hostname resolves to.
            gloo_opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, gloo_opts)
        group = cls(rank, world_size, pg, device)
        # Connect now (NCCL builds its communicator lazily) so a broken peer shows at start.
        group.all_reduce(torch.zeros(1, device=device))
        return group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.world_size > 1:
            self.pg.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's `tensor` along the last dim; rank r's holds sizes[r]
        columns (shards may differ by one, so they travel padded to the largest)."""
        if self.world_size == 1:
            return tensor
        width = max(sizes)
        if tensor.shape[-1] < width:
            tensor = torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.pg.allgather([parts], [tensor]).wait()
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            self.pg.broadcast(tensor, src).wait()
        return tensor

    def abort(self) -> None:
        abort_process_group(self.pg)

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}/{self.world_size}, device={self.device})"


_SINGLE = TPGroup()
_current: contextvars.ContextVar[TPGroup] = contextvars.ContextVar("rlserve_tp_group", default=_SINGLE)


@contextlib.contextmanager
def tp_group_scope(group: TPGroup | None) -> Iterator[TPGroup]:
    """Layers constructed inside take `group` as their tensor-parallel group."""
    token = _current.set(group or _SINGLE)
    try:
        yield _current.get()
    finally:
        _current.reset(token)


def current_tp_group() -> TPGroup:
    return _current.get()
