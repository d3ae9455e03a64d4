"""What API servers and the engine-core process say to each other over ZeroMQ.

msgpack through msgspec structs: every message is typed and validated when decoded,
nothing is pickled.

API server -> engine (one PULL socket the engine binds; every API server PUSHes to it):
    AddRequest       a prompt with its sampling parameters (its n samples are made there)
    AbortRequests    end these samples now
    UtilityCall      a control call (pause, update, sleep, stats, ...), answered by a CallResult
    LoadLoRAAdapter, UnloadLoRAAdapter   adapter calls (typed), answered by a CallResult
Engine -> API server (one PULL socket per API server, which binds it; the engine PUSHes):
    EngineReady      once, when the model is loaded: what the front end needs to know
    EngineCoreOutputs  one per step: see outputs.py
    CallResult       the answer to a UtilityCall
    EngineDead       the engine is stopping on an error; the reason says why
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from rlserve.engine.outputs import EngineCoreOutputs
from rlserve.engine.request import EngineUnavailableError
from rlserve.sampling_params import InvalidRequestError, SamplingParams


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


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str
    args: list[Any] = []
    client: int = 0


class LoadLoRAAdapter(msgspec.Struct, tag="load_lora", array_like=True):
    """Load a PEFT adapter directory as `lora_name` (vLLM's /v1/load_lora_adapter)."""

    call_id: int
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace a loaded adapter of that name
    client: int = 0

    def as_call(self) -> UtilityCall:
        return UtilityCall(self.call_id, "load_lora", [self.lora_name, self.lora_path, self.load_inplace],
                           self.client)


class UnloadLoRAAdapter(msgspec.Struct, tag="unload_lora", array_like=True):
    call_id: int
    lora_name: str
    client: int = 0

    def as_call(self) -> UtilityCall:
        return UtilityCall(self.call_id, "unload_lora", [self.lora_name], self.client)


class LoRAAdapterInfo(msgspec.Struct):
    """A loaded adapter, as list_loras and load_lora answer."""

    name: str
    slot: int
    path: str | None  # None: pushed by a trainer
    r: int
    lora_alpha: float


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


class CallResult(msgspec.Struct, tag="result", array_like=True, omit_defaults=True):
    call_id: int
    ok: bool
    value: Any = None
    error: str = ""
    error_type: str = ""
    param: str | None = None


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    reason: str


EngineInput = Union[AddRequest, AbortRequests, UtilityCall, LoadLoRAAdapter, UnloadLoRAAdapter]
EngineOutput = Union[EngineCoreOutputs, CallResult, EngineReady, EngineDead]


class ModelNotFoundError(InvalidRequestError):
    """`model` (or `param`) names neither the served model nor a loaded adapter (HTTP 404)."""

    def __init__(self, message: str, param: str | None = "model"):
        super().__init__(message, param)


class ConflictError(RuntimeError):
    """The call collides with one already under way (HTTP 409)."""


class EngineDeadError(RuntimeError):
    """The engine core stopped on an error; every request fails with this (HTTP 503)."""


def _error_types() -> dict[str, type[BaseException]]:
    from rlserve.weight_transfer.errors import InvalidUpdateError, UpdateRefusedError, WeightTransferError
    types = [ModelNotFoundError, InvalidRequestError, EngineUnavailableError, ConflictError, EngineDeadError,
             InvalidUpdateError, UpdateRefusedError, WeightTransferError, ValueError, RuntimeError]
    return {t.__name__: t for t in types}


def error_result(call_id: int, e: BaseException) -> CallResult:
    return CallResult(call_id, False, error=str(e), error_type=type(e).__name__,
                      param=getattr(e, "param", None))


def error_from_result(r: CallResult) -> BaseException:
    """The engine's exception, as its own type where the front end maps it to a status."""
    cls = _error_types().get(r.error_type)
    if cls is InvalidRequestError:
        return InvalidRequestError(r.error, r.param)
    if cls is ModelNotFoundError:
        return ModelNotFoundError(r.error, r.param)
    if cls is None:
        return RuntimeError(f"{r.error_type}: {r.error}")
    return cls(r.error)
