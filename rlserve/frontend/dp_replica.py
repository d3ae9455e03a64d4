"""One data-parallel replica as the front end sees it (dp_client.py): its connection and
its state.

States: starting -> up; up -> down (died) -> starting; stale: alive, but serves nothing
until it has the current weights (dp_weights.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlserve.frontend.core_client import EngineCoreClient
from rlserve.wire.messages import AnyControlCall, CallResult, EngineReady, error_from_result

STARTING, UP, STALE, DOWN = "starting", "up", "stale", "down"


@dataclass
class Replica:
    index: int
    client: EngineCoreClient
    state: str = STARTING
    reason: str = ""  # why it is down or stale
    info: EngineReady | None = None  # once started
    incarnation: int = 0  # bumped on every restart: callbacks of an old one are ignored
    restarts: int = 0
    requests_total: int = 0
    weight_version: int | None = None

    @property
    def alive(self) -> bool:
        return self.state in (UP, STALE)


def combine_errors(errors: list[tuple[int, BaseException]], note: str = "") -> BaseException:
    """Per-replica failures as one exception of the first one's type (so it maps to the
    same HTTP status), naming every replica."""
    first = errors[0][1]
    message = "; ".join(f"replica {i}: {e}" for i, e in errors) + (f" ({note})" if note else "")
    return error_from_result(CallResult(0, False, error=message, error_type=type(first).__name__,
                                        param=getattr(first, "param", None)))


async def call_all(replicas: list[Replica], body: Callable[[Replica], AnyControlCall]) -> dict[int, Any]:
    """Each replica's answer to its call (`body(replica)`), by index; any failure raises
    every replica's at once (combine_errors)."""
    got = await asyncio.gather(*(r.client.call(body(r)) for r in replicas), return_exceptions=True)
    failed = [(r.index, e) for r, e in zip(replicas, got) if isinstance(e, BaseException)]
    if failed:
        raise combine_errors(failed)
    return {r.index: v for r, v in zip(replicas, got)}
