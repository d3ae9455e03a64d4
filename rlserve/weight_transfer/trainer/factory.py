"""The trainer side under today's vLLM names: a factory that joins the server's group and
an engine whose `send_weights()` runs the whole transaction.

    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(master_address="127.0.0.1", master_port=port),
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"),
        source=ModuleSource(model))
    engine.send_weights()      # /start_weight_update, /update_weights, /finish_weight_update

The client is anything with the four control calls (http_client.HTTPVLLMWeightSyncClient,
or one of your own). The IPC backend (`IPCTrainerInitInfo`) forms no group: each push
sends the handles of the source's tensors in /update_weights (JSON, never pickle).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..group import DEFAULT_TIMEOUT_S, TransferGroup
from ..packing import dtype_name
from .gloo import GlooWeightTransferEngine
from .http_client import BackgroundCall
from .ipc_sender import IPCSender, IPCWeightTransferEngine
from .nccl import NCCLWeightTransferEngine


class VLLMWeightSyncClient(Protocol):
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Any: ...
    def start_weight_update(self) -> Any: ...
    def update_weights(self, update_info: dict[str, Any]) -> Any: ...
    # Called without the version where send_weights is given none.
    def finish_weight_update(self, weight_version: str | int | None = None) -> Any: ...
    # Asked only where the init info leaves world_size out.
    def get_world_size(self) -> int: ...


class ModuleSource:
    """The tensors to send: a module's parameters, under their checkpoint names."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.module.named_parameters()


@dataclass
class NCCLTrainerInitInfo:
    master_address: str
    master_port: int
    world_size: int | None = None  # None: asked of the server (its /get_world_size, plus this trainer)
    rank_offset: int = 1
    packed: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    device: str | None = None  # the GPU the tensors are on (NCCL binds the group to it)

    backend = "nccl"


@dataclass
class GlooTrainerInitInfo(NCCLTrainerInitInfo):
    backend = "gloo"


@dataclass
class IPCTrainerInitInfo:
    rank: int = 0  # the sender
    packed: bool = False  # accepted as vLLM sends it; IPC packs nothing, the server reads in place

    backend = "ipc"


class TrainerWeightTransferEngine:
    """A joined trainer: `send_weights()` pushes the source's tensors in one transaction."""

    def __init__(self, init_info, client: VLLMWeightSyncClient, source, group: TransferGroup | IPCSender):
        self.init_info, self.client, self.source, self.group = init_info, client, source, group

    def send_weights(self, weight_version: str | int | None = None) -> None:
        """start, update (the bytes go while the server receives), finish; if the send or
        the server fails, the transaction is left to the server to abandon and the error
        is raised here (the server keeps serving the weights it had)."""
        self.client.start_weight_update()
        tensors = list(self.source.named_tensors())
        if isinstance(self.group, IPCSender):
            self.client.update_weights(self.group.update_info(tensors))
        else:
            self._send_collective(self.group, tensors)
        finish = self.client.finish_weight_update
        finish(weight_version) if weight_version is not None else finish()

    def _send_collective(self, group: TransferGroup, tensors: list[tuple[str, torch.Tensor]]) -> None:
        packed = self.init_info.packed
        info = dict(names=[n for n, _ in tensors], dtype_names=[dtype_name(t.dtype) for _, t in tensors],
                    shapes=[list(t.shape) for _, t in tensors], packed=packed)
        call = BackgroundCall(self.client.update_weights, info)
        engine = NCCLWeightTransferEngine if group.backend == "nccl" else GlooWeightTransferEngine
        try:
            engine.trainer_send_weights(iterator=iter(tensors), group=group, packed=packed)
        finally:
            call.result()


class WeightTransferTrainerFactory:
    @staticmethod
    def trainer_init(init_info, client: VLLMWeightSyncClient, source) -> TrainerWeightTransferEngine:
        """Join the server's weight transfer (its /init_weight_transfer_engine, called from
        a thread while this process forms the group it is rank 0 of)."""
        if isinstance(init_info, dict):
            init_info = _init_info_from_dict(init_info)
        if isinstance(init_info, IPCTrainerInitInfo):
            client.init_weight_transfer_engine({})
            return TrainerWeightTransferEngine(init_info, client, source, IPCWeightTransferEngine.trainer_init())
        world_size = init_info.world_size
        if world_size is None:
            world_size = client.get_world_size() + init_info.rank_offset
        server_info = dict(master_address=init_info.master_address, master_port=init_info.master_port,
                           rank_offset=init_info.rank_offset, world_size=world_size)
        call = BackgroundCall(client.init_weight_transfer_engine, server_info)
        engine = NCCLWeightTransferEngine if init_info.backend == "nccl" else GlooWeightTransferEngine
        try:
            group = engine.trainer_init(dict(master_address=init_info.master_address,
                                             master_port=init_info.master_port, world_size=world_size,
                                             timeout_s=init_info.timeout_s), device=init_info.device)
        finally:
            call.result()
        return TrainerWeightTransferEngine(init_info, client, source, group)


def _init_info_from_dict(data: dict[str, Any]):
    data = dict(data)
    kind = {"nccl": NCCLTrainerInitInfo, "gloo": GlooTrainerInitInfo, "ipc": IPCTrainerInitInfo}
    backend = data.pop("backend", "ipc" if "master_address" not in data else "nccl")
    if backend not in kind:
        raise ValueError(f"init_info.backend: must be one of {', '.join(kind)}, got {backend!r}")
    return kind[backend](**data)
