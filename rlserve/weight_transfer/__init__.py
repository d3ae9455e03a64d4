"""Live weight transfer from a trainer (rank 0) to the server's workers (ranks 1..N).

Trainer side, as in vLLM's RLHF-over-HTTP example::

    from rlserve.weight_transfer import NCCLWeightTransferEngine, get_ip, get_open_port
    group = NCCLWeightTransferEngine.trainer_init(dict(master_address=..., master_port=..., world_size=...))
    NCCLWeightTransferEngine.trainer_send_weights(iterator=model.named_parameters(), group=group, packed=True)

Server side: `receiver_init` per worker, then `receive_weights` per update (or `refuse`,
for an update the server turns down before looking at it).
Same GPU (colocated): `IPCWeightTransferEngine` shares CUDA IPC handles instead (ipc.py).
Today's vLLM names work too: `trainer_args=NCCLTrainerSendWeightsArgs(group=..., packed=True)`
(or a dict), and `WeightTransferTrainerFactory.trainer_init(init_info=..., client=
HTTPVLLMWeightSyncClient(url), source=ModuleSource(model)).send_weights()` (trainer/factory.py).

The names below load on first use (PEP 562): a trainer that imports the package loads only
the trainer side, a server rank only the server side, and the model imports none of it.

Modules, by side (imports run from the sides to the shared layer, never back, never across):
trainer/ (what a training process imports): engine, gloo, nccl, ipc_sender, http_client,
client, factory;
server/ (what the server's ranks run): receiver, ipc_receiver, peer;
shared, here: info (init_info and update_info, parsed once), group (store + data plane,
bounded and abortable), store_keys (the control keys, and failures told to the peers),
handshake (pairing each push with each rank's request), pipeline (packing, overlap,
checksums), tcp (the CPU data plane), packing (the bucket plan), checksum, ipc (the CUDA
IPC wire format), address (master_address), errors.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .address import get_ip, get_open_port, rendezvous_address
    from .errors import InvalidUpdateError, UpdateRefusedError, WeightTransferError
    from .group import DEFAULT_TIMEOUT_S, TransferGroup
    from .handshake import refuse
    from .info import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, InitInfo, UpdateInfo
    from .ipc import IPCHandles
    from .packing import (
        Bucket,
        Slot,
        TensorMeta,
        plan_buckets,
        plan_digest,
    )
    from .server.ipc_receiver import IPCReceiver
    from .server.receiver import ExpectedParam, ExpectedWeights, receive_weights, receiver_init
    from .trainer.client import PushResult, WeightSyncClient
    from .trainer.engine import GlooTrainerSendWeightsArgs, NCCLTrainerSendWeightsArgs
    from .trainer.factory import (
        GlooTrainerInitInfo,
        IPCTrainerInitInfo,
        ModuleSource,
        NCCLTrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferTrainerFactory,
    )
    from .trainer.gloo import GlooWeightTransferEngine
    from .trainer.http_client import HTTPVLLMWeightSyncClient
    from .trainer.ipc_sender import IPCSender, IPCTrainerSendWeightsArgs, IPCWeightTransferEngine
    from .trainer.nccl import NCCLWeightTransferEngine

# Each public name -> the module that defines it, by side.
_NAMES = {
    # trainer
    "PushResult": "trainer.client",
    "WeightSyncClient": "trainer.client",
    "GlooWeightTransferEngine": "trainer.gloo",
    "HTTPVLLMWeightSyncClient": "trainer.http_client",
    "IPCSender": "trainer.ipc_sender",
    "IPCTrainerSendWeightsArgs": "trainer.ipc_sender",
    "IPCWeightTransferEngine": "trainer.ipc_sender",
    "NCCLWeightTransferEngine": "trainer.nccl",
    "GlooTrainerSendWeightsArgs": "trainer.engine",
    "NCCLTrainerSendWeightsArgs": "trainer.engine",
    "GlooTrainerInitInfo": "trainer.factory",
    "IPCTrainerInitInfo": "trainer.factory",
    "ModuleSource": "trainer.factory",
    "NCCLTrainerInitInfo": "trainer.factory",
    "TrainerWeightTransferEngine": "trainer.factory",
    "WeightTransferTrainerFactory": "trainer.factory",
    # server
    "IPCReceiver": "server.ipc_receiver",
    "ExpectedParam": "server.receiver",
    "ExpectedWeights": "server.receiver",
    "receive_weights": "server.receiver",
    "receiver_init": "server.receiver",
    # shared
    "get_ip": "address",
    "get_open_port": "address",
    "rendezvous_address": "address",
    "InvalidUpdateError": "errors",
    "UpdateRefusedError": "errors",
    "WeightTransferError": "errors",
    "DEFAULT_TIMEOUT_S": "group",
    "TransferGroup": "group",
    "refuse": "handshake",
    "IPCHandles": "ipc",
    "Bucket": "packing",
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES": "info",
    "DEFAULT_PACKED_NUM_BUFFERS": "info",
    "InitInfo": "info",
    "UpdateInfo": "info",
    "Slot": "packing",
    "TensorMeta": "packing",
    "plan_buckets": "packing",
    "plan_digest": "packing",
}

__all__ = [
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES", "DEFAULT_PACKED_NUM_BUFFERS", "DEFAULT_TIMEOUT_S",
    "Bucket", "ExpectedParam", "ExpectedWeights", "GlooWeightTransferEngine", "IPCHandles", "IPCReceiver", "IPCSender",
    "IPCWeightTransferEngine", "InitInfo", "InvalidUpdateError",
    "NCCLWeightTransferEngine", "Slot", "TensorMeta", "TransferGroup", "UpdateInfo",
    "UpdateRefusedError", "WeightTransferError", "get_ip", "get_open_port", "rendezvous_address", "plan_buckets",
    "plan_digest", "receive_weights", "receiver_init", "refuse", "PushResult", "WeightSyncClient",
    "HTTPVLLMWeightSyncClient", "NCCLTrainerSendWeightsArgs", "GlooTrainerSendWeightsArgs",
    "IPCTrainerSendWeightsArgs", "NCCLTrainerInitInfo", "GlooTrainerInitInfo", "IPCTrainerInitInfo",
    "ModuleSource", "TrainerWeightTransferEngine", "WeightTransferTrainerFactory",
]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
