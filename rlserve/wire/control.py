"""The engine's answers to control calls, one struct per call (the calls: messages.py).

The engine builds them (engine/weight_updates.py, core_proc.py), they travel inside a
CallResult, and the front end's client turns each back into its struct
(`reply_type`), so no layer above reads a string-keyed answer. The HTTP routes build
vLLM's answers from them; where a route passes one on whole (`to_builtins`), its fields'
order and what it leaves out (omit_defaults) are the JSON clients see.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Paused(msgspec.Struct, omit_defaults=True):
    """/pause holds: `mode` as asked, or "keep" where a wait found its requests unable to
    run (a sleep or keep-pause came first) and `kept` counts them."""

    mode: str
    kept: int | None = None


class WeightsUpdated(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An update received and applied (or, inside a transaction, `staged` as its `part`-th).
    Data parallel: the replicas' answers, each naming its `replica`, in `replicas`."""

    replica: int | None = None
    message: str
    staged: bool = False
    part: int | None = None
    weight_version: int
    num_bytes: int
    receive_seconds: float
    apply_seconds: float
    skipped: int  # names taken and dropped (a multimodal trainer's vision tower)
    replicas: list[WeightsUpdated] | None = None


class WeightUpdateStarted(msgspec.Struct):
    message: str
    transaction: int  # its number on this server
    transaction_id: str  # its owner's name for it (given, or made)


class WeightUpdateFinished(msgspec.Struct):
    message: str
    weight_version: str  # as vLLM reports it: the label, or the number as a string
    number: int
    parts: int
    num_bytes: int
    apply_seconds: float
    transaction_id: str


class WeightVersionSet(msgspec.Struct):
    success: bool
    new_version: str  # the label, or the number as a string
    number: int


class TransferShutDown(msgspec.Struct):
    message: str


class LoRAAdapterInfo(msgspec.Struct):
    """A loaded adapter, as list_loras and load_lora answer."""

    name: str
    slot: int
    path: str | None  # None: pushed by a trainer
    r: int
    lora_alpha: float


class PeerCopied(msgspec.Struct):
    """A data-parallel replica's weights copied to or from a peer."""

    weight_version: int
    num_bytes: int


# One rank's digest of each of its parameters, per rank; /weight_checker's reset answers
# {"reset": true} instead.
Checksums = list[dict[str, str]] | dict[str, bool]


def reply_type(body: Any) -> Any:
    """The answer's type for a call body (Any: the call answers a plain value, or nothing)."""
    return getattr(type(body), "reply", Any)
