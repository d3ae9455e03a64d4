"""The calls the engine makes on every rank, one typed message each.

Each is a msgspec struct (it crosses to ranks 1..N-1 as msgpack, never pickle) that says
what it does on a rank in `run`. `background` calls wait on the trainer, not on the
rank's model: a worker process runs them beside its steps, as rank 0 runs them on a
thread of the engine's. `TensorCall`s carry tensors, which rank 0 broadcasts over the
tensor-parallel group (Executor.load_tensors) instead of sending them in the message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from rlserve.weight_transfer.info import InitInfo, UpdateInfo

if TYPE_CHECKING:
    import torch

    from rlserve.worker.worker import Worker


class RankCall(msgspec.Struct, array_like=True, tag=True):
    background: ClassVar[bool] = False

    def run(self, worker: Worker) -> Any:
        raise NotImplementedError


class SizeKVCache(RankCall):
    """The rank's KVSizing (worker/memory_profile.py), in msgpack's vocabulary."""

    max_model_len: int

    def run(self, worker: Worker) -> Any:
        return msgspec.to_builtins(worker.size_kv_cache(self.max_model_len))


class InitKVCache(RankCall):
    num_blocks: int

    def run(self, worker: Worker) -> None:
        worker.init_kv_cache(self.num_blocks)


class CaptureCudaGraphs(RankCall):
    max_num_seqs: int
    max_model_len: int

    def run(self, worker: Worker) -> None:
        worker.capture_cuda_graphs(self.max_num_seqs, self.max_model_len)


class Sleep(RankCall):
    level: int

    def run(self, worker: Worker) -> None:
        worker.sleep(self.level)


class ReleaseKVCache(RankCall):
    def run(self, worker: Worker) -> None:
        worker.release_kv_cache()


class WakeUp(RankCall):
    tags: list[str] | None = None

    def run(self, worker: Worker) -> None:
        worker.wake_up(self.tags)


class RemoveLoRA(RankCall):
    """Clear a slot (if given) and forget the adapter `name`'s host copy (if given)."""

    slot: int | None
    name: str | None = None

    def run(self, worker: Worker) -> None:
        worker.remove_lora(self.slot, self.name)


class SwapLoRA(RankCall):
    """Save a slot into the host copy of the adapter leaving it (a push changed it there),
    then copy the host copy of the adapter coming in into the slot (either may be absent)."""

    slot: int
    save: str | None = None
    restore: str | None = None

    def run(self, worker: Worker) -> None:
        worker.swap_lora(self.slot, self.save, self.restore)


# -- weight updates (rlserve/worker/weight_receiver.py) ------------------------------------


class JoinTransfer(RankCall):
    background: ClassVar[bool] = True
    backend: str
    init_info: InitInfo | None  # None: the ipc backend
    timeout_s: float

    def run(self, worker: Worker) -> None:
        worker.receiver.join(self.backend, self.init_info, self.timeout_s)


class ReceiveWeights(RankCall):
    background: ClassVar[bool] = True
    update_info: UpdateInfo
    lora_config: dict | None = None
    part: bool = False  # one part of a transaction (/start_weight_update)

    def run(self, worker: Worker) -> int:
        return worker.receiver.receive(self.update_info, self.lora_config, self.part)


class RefuseUpdate(RankCall):
    background: ClassVar[bool] = True
    message: str

    def run(self, worker: Worker) -> None:
        worker.receiver.refuse(self.message)


class ApplyStaged(RankCall):
    """Apply what is staged: an adapter's update goes to its slot, or (None) to the host
    copy of `lora_name`."""

    lora_slot: int | None = None
    lora_name: str | None = None
    complete: bool = False  # a transaction's parts must carry every required weight (no weights served yet)

    def run(self, worker: Worker) -> None:
        worker.receiver.apply(self.lora_slot if self.lora_slot is not None else self.lora_name, self.complete)


class DropStaged(RankCall):
    def run(self, worker: Worker) -> None:
        worker.receiver.drop()


class CloseTransfer(RankCall):
    reason: str

    def run(self, worker: Worker) -> None:
        worker.receiver.abort(self.reason)
        worker.receiver.close()


class Checksums(RankCall):
    # Reads the parameters beside the steps; the engine reads again if a commit came meanwhile.
    background: ClassVar[bool] = True

    def run(self, worker: Worker) -> dict[str, str]:
        return worker.receiver.checksums()


class ResetWeights(RankCall):
    """Overwrite every parameter with noise (/weight_checker's reset)."""

    def run(self, worker: Worker) -> None:
        worker.receiver.reset()


class WeightsLayout(RankCall):
    def run(self, worker: Worker) -> str:
        return worker.receiver.layout()


class CopyPeer(RankCall):
    """Send this rank's parameters to the same rank of another replica, or receive them."""

    send: bool
    address: str
    ports: list[int]
    digest: str | None
    timeout_s: float

    def run(self, worker: Worker) -> int:
        return worker.receiver.copy_peer(self.send, self.address, self.ports, self.digest, self.timeout_s)


# -- calls that carry tensors ----------------------------------------------------------------


class TensorCall(RankCall):
    def run_with(self, worker: Worker, tensors: list[tuple[str, torch.Tensor]]) -> Any:
        raise NotImplementedError


class LoadWeights(TensorCall):
    def run_with(self, worker: Worker, tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
        return sorted(worker.load_weights(tensors))


class LoadLoRA(TensorCall):
    """An adapter read from disk: into its host copy, and into `slot` if given."""

    name: str
    slot: int | None
    config: dict

    def run_with(self, worker: Worker, tensors: list[tuple[str, torch.Tensor]]) -> None:
        worker.load_lora(tensors, self.name, self.slot, self.config)


AnyTensorCall = LoadWeights | LoadLoRA  # what a "load" message carries
AnyRankCall = (
    SizeKVCache
    | InitKVCache
    | CaptureCudaGraphs
    | Sleep
    | WakeUp
    | RemoveLoRA
    | SwapLoRA
    | JoinTransfer
    | ReceiveWeights
    | RefuseUpdate
    | ApplyStaged
    | DropStaged
    | CloseTransfer
    | Checksums
    | WeightsLayout
    | CopyPeer
    | AnyTensorCall
)
