"""The errors that cross a process boundary, and the one registry that carries them.

An exception raised in the engine process or on a tensor-parallel rank reaches the API
server as (type name, message, param) and is raised there again as the same type, so
the HTTP status it maps to does not depend on where it was raised. Each class carries
that status (`http_status`); one handler in the server (server/app.py) answers them all.
A type missing from the registry arrives as a RuntimeError that names it.

A leaf: it imports nothing of rlserve, so every layer (the model's PEFT checks, the weight
transfer, the engine, the front end) can raise these. sampling_params and
weight_transfer.errors re-export the ones they are known by.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple


class StatusError(Exception):
    """An error the HTTP layer answers with its class's status, as vLLM's error body."""

    http_status: ClassVar[int] = 500
    error_type: ClassVar[str | None] = None  # the body's `type`; None: by the status
    message_prefix: ClassVar[str] = ""  # leads the body's message
    param: str | None = None  # the request field at fault, where one is


class InvalidRequestError(StatusError, ValueError):
    """A user error. `param` names the offending field; the server turns this into a 400."""

    http_status = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# The weight transfer's two families, kept apart so a handler maps them without caring about
# `except` order: the trainer's request is wrong (400; the group stays usable and the old
# weights keep serving), or the transport failed (the group must be initialised again).
class InvalidUpdateError(StatusError, ValueError):
    """A trainer-supplied init_info/update_info is invalid; the message names the fields.
    The route that carried it sets `param` (init_info or update_info)."""

    http_status = 400


class WeightTransferError(StatusError, RuntimeError):
    """The transfer itself failed or timed out; the group is unusable until re-init."""

    # The trainer side failed or vanished: not the caller's input, not a server bug.
    http_status = 502
    error_type = "weight_transfer_error"
    message_prefix = "weight transfer failed, previous weights still serving: "


class UpdateRefusedError(WeightTransferError):
    """Trainer side: the server refused the update before any byte moved.

    The message is exactly the one the server returned in its HTTP 400, and the
    group stays usable for the next (corrected) update.
    """


class ModelNotFoundError(InvalidRequestError):
    """`model` (or `param`) names neither the served model nor a loaded adapter."""

    http_status = 404

    def __init__(self, message: str, param: str | None = "model"):
        super().__init__(message, param)


class PayloadTooLargeError(InvalidRequestError):
    """More than a bound allows to be held at once."""

    http_status = 413


class ConflictError(StatusError, RuntimeError):
    """The call collides with one already under way."""

    http_status = 409


class EngineUnavailableError(StatusError, RuntimeError):
    """Generation cannot run now, for a reason the caller can wait out."""

    http_status = 503


class EngineDeadError(StatusError, RuntimeError):
    """The engine core stopped on an error; every request fails with this (not the
    caller's fault, nor a bug in this request: the engine is gone)."""

    http_status = 503


# Subclasses before the classes they extend: a lookup by name never loses the subclass.
_REGISTRY: dict[str, type[BaseException]] = {t.__name__: t for t in (
    ModelNotFoundError, PayloadTooLargeError, InvalidRequestError, ConflictError, EngineUnavailableError,
    EngineDeadError,
    InvalidUpdateError, UpdateRefusedError, WeightTransferError,
    ValueError, KeyError, TypeError, RuntimeError, MemoryError, NotImplementedError)}


class WireError(NamedTuple):
    """An exception as it travels: its type's name, its message, the field it names."""

    type: str
    message: str
    param: str | None = None


def to_wire(e: BaseException) -> WireError:
    message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return WireError(type(e).__name__, str(message), getattr(e, "param", None))


def from_wire(w: WireError, prefix: str = "") -> BaseException:
    """The exception again, as its own type where it is registered; `prefix` (say "rank 1: ")
    leads the message."""
    cls = _REGISTRY.get(w.type)
    message = prefix + w.message
    if cls is None:
        return RuntimeError(f"{prefix}{w.type}: {w.message}")
    if issubclass(cls, InvalidRequestError):
        return cls(message, w.param)
    return cls(message)
