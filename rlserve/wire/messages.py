"""What API servers and the engine-core process say to each other over ZeroMQ.

msgpack through msgspec structs: every message is typed and validated when decoded,
nothing is pickled.

API server -> engine (one PULL socket the engine binds; every API server PUSHes to it):
    AddRequest       a prompt with its sampling parameters (its n samples are made there)
    AbortRequests    end these samples now
    Call             a control call: its id and its body, one struct per call (Pause, UpdateWeights,
                     LoadLoRAAdapter, ...), answered by a CallResult
Engine -> API server (one PULL socket per API server, which binds it; the engine PUSHes):
    EngineReady      once, when the model is loaded: what the front end needs to know
    EngineCoreOutputs  one per step: see outputs.py
    CallResult       the answer to a Call (an error as rlserve/errors.py carries it)
    EngineDead       the engine is stopping on an error; the reason says why
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from rlserve.errors import (  # noqa: F401 (re-exported)
    ConflictError,
    EngineDeadError,
    EngineUnavailableError,
    ModelNotFoundError,
    WireError,
    from_wire,
    to_wire,
)
from rlserve.memory import MemoryProfile
from rlserve.sampling_params import SamplingParams
from rlserve.weight_transfer.info import InitInfo, UpdateInfo
from rlserve.wire.control import (  # noqa: F401 (LoRAAdapterInfo re-exported)
    Checksums,
    LoRAAdapterInfo,
    Paused,
    PeerCopied,
    TransferShutDown,
    WeightsUpdated,
    WeightUpdateFinished,
    WeightUpdateStarted,
    WeightVersionSet,
)
from rlserve.wire.outputs import EngineCoreOutputs, EngineStats


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool  # report its tokens every step (else once, when it finishes)
    client: int = 0  # the API server it came from: its outputs go back there
    cache_salt: str | None = None
    lora_name: str | None = None  # a loaded LoRA adapter to run with (None: the base model)


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


# -- control calls: one struct per call, sent inside a Call ---------------------------------

class ControlCall(msgspec.Struct, array_like=True, tag=True):
    """A control call's body; the engine answers each with a CallResult, whose value is a
    `reply` (control.py; Any: a plain value, or nothing)."""

    reply: ClassVar[Any] = Any


class Pause(ControlCall):
    reply = Paused
    mode: str = "abort"
    clear_cache: bool = False


class Resume(ControlCall):
    pass


class Sleep(ControlCall):
    level: int = 1


class WakeUp(ControlCall):
    tags: list[str] | None = None  # "weights", "kv_cache"; None: everything


class ReleaseKVCache(ControlCall):
    """Give the KV cache's memory back, weights kept (vLLM's /release_kv_cache_memory)."""


class ResetPrefixCache(ControlCall):
    pass


class GetStats(ControlCall):
    reply = EngineStats


class AbortAll(ControlCall):
    reply = int  # how many requests were ended


class Shutdown(ControlCall):
    pass


class ListLoRAAdapters(ControlCall):
    reply = list[LoRAAdapterInfo]


class LoadLoRAAdapter(ControlCall):
    """Load a PEFT adapter directory as `lora_name` (vLLM's /v1/load_lora_adapter)."""

    reply = LoRAAdapterInfo

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace a loaded adapter of that name


class UnloadLoRAAdapter(ControlCall):
    lora_name: str


# Weight updates (engine/weight_updates.py owns them).

# init_info and update_info arrive parsed (the API server parsed them: rlserve.weight_transfer.info).
class InitWeightTransfer(ControlCall):
    backend: str
    init_info: InitInfo | None  # None: the ipc backend, which forms no group
    timeout_s: float


class UpdateWeights(ControlCall):
    reply = WeightsUpdated
    update_info: UpdateInfo | None = None  # None: refused by the API server
    weight_version: int | str | None = None  # parsed by rlserve.wire.weight_version
    transaction_id: str | None = None  # the open transaction this part belongs to (checked if given)
    # Refused already by the API server (a field out of range, an update_info that does not
    # parse): the engine only passes the refusal to the trainer, which would otherwise wait
    # its whole timeout for a plan's answer.
    refusal: str | None = None
    refusal_param: str | None = None


class StartWeightUpdate(ControlCall):
    """Open a transaction: the /update_weights that follow stage, /finish_weight_update commits."""

    reply = WeightUpdateStarted

    is_checkpoint_format: bool = True
    transaction_id: str | None = None  # the owner's name for it; None: the server picks one


class FinishWeightUpdate(ControlCall):
    reply = WeightUpdateFinished
    weight_version: int | str | None = None  # parsed by rlserve.wire.weight_version
    transaction_id: str | None = None


class SetWeightVersion(ControlCall):
    reply = WeightVersionSet
    new_version: int | str


class ShutdownWeightTransfer(ControlCall):
    reply = TransferShutDown
    # What a trainer that is (or will be) pushing reads as the group's failure.
    reason: str = "the weight-transfer engine was shut down"


class WeightChecksums(ControlCall):
    """Each rank's digest of each of its parameters (what /weight_checker compares); with
    `reset`, noise over every parameter instead (nothing is served until a full update)."""

    reply = Checksums
    reset: bool = False


class WeightsLayout(ControlCall):
    reply = list[str]  # each rank's digest of its parameters' names, shapes and dtypes


class CopyWeightsToPeer(ControlCall):
    reply = PeerCopied
    address: str
    ports: list[int]
    digests: list[str]
    timeout_s: float


class CopyWeightsFromPeer(ControlCall):
    reply = PeerCopied
    address: str
    ports: list[int]
    digests: list[str]
    timeout_s: float
    weight_version: int


WeightCall = (InitWeightTransfer | UpdateWeights | StartWeightUpdate | FinishWeightUpdate | SetWeightVersion
              | ShutdownWeightTransfer | WeightChecksums | WeightsLayout | CopyWeightsToPeer | CopyWeightsFromPeer)

AnyControlCall = (Pause | Resume | Sleep | WakeUp | ReleaseKVCache | ResetPrefixCache | GetStats | AbortAll | Shutdown
                  | ListLoRAAdapters | LoadLoRAAdapter | UnloadLoRAAdapter | WeightCall)


class Call(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    body: AnyControlCall
    client: int = 0  # the API server it came from: the answer goes back there


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    max_model_len: int
    vocab_size: int
    world_size: int
    eos_token_ids: list[int]
    weight_version: int
    kv_capacity_tokens: int
    model_type: str
    device: str
    dtype: str
    load_seconds: float
    pid: int
    host: str = ""  # an address other hosts reach this one at (data-parallel weight copies)
    memory: MemoryProfile | None = None  # rank 0's device memory at start (None: not measured)
    moe: bool = False  # the model has mixture-of-experts layers
    routed_experts: bool = False  # it records them (enable_return_routed_experts)


class CallResult(msgspec.Struct, tag="result", array_like=True, omit_defaults=True):
    call_id: int
    ok: bool
    value: Any = None
    error: str = ""
    error_type: str = ""
    param: str | None = None


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    reason: str


EngineInput = AddRequest | AbortRequests | Call
EngineOutput = EngineCoreOutputs | CallResult | EngineReady | EngineDead


def error_result(call_id: int, e: BaseException) -> CallResult:
    w = to_wire(e)
    return CallResult(call_id, False, error=w.message, error_type=w.type, param=w.param)


def error_from_result(r: CallResult) -> BaseException:
    """The engine's exception, as its own type where the front end maps it to a status."""
    return from_wire(WireError(r.error_type, r.error, r.param))


LATER = object()  # a control call's handler answers it later, through the loop's callback
