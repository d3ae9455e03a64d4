"""/weight_checker on the engine's side: each rank's digests of its parameters, read on a
thread beside the steps (hashing a large model takes seconds, and generation goes on), one
reading shared by the calls that arrive meanwhile; and `reset`, noise over every
parameter, after which nothing is served until a full update."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from rlserve.errors import ConflictError
from rlserve.wire.messages import LATER, Call, WeightChecksums
from rlserve.worker import calls as rank


class Updates(Protocol):
    """What the checker needs of the engine's owner of updates (weight_updates.py)."""

    core: Any
    commits: int  # weights copied in so far: a reading that saw one land is read again
    answer: Callable[..., None]

    def beside(self, name: str, fn: Callable[[], None]) -> None: ...


MAX_WAITING_CALLS = 64  # /weight_checker calls waiting on one reading: more is a 409


class WeightChecker:
    def __init__(self, updates: Updates):
        self.updates = updates
        self._waiting: list[Call] = []  # calls waiting on the reading under way
        self._lock = threading.Lock()

    def handle(self, call: Call, body: WeightChecksums) -> Any:
        """Digests are computed on a thread beside the steps (hashing a large model takes
        seconds); calls that arrive meanwhile share that computation, and a commit that
        lands while it reads the parameters makes it read them again."""
        if self.updates.core.state.sleeping:
            raise ConflictError("weight_checker requires an awake, unpaused engine")
        if body.reset:
            self.updates.core.executor.collective_rpc(rank.ResetWeights())
            self.updates.core.state.no_weights = True  # noise is not served: a full update ends this
            self.updates.commits += 1
            self.updates.core.new_weight_version(None)
            return {"reset": True}
        with self._lock:
            if len(self._waiting) >= MAX_WAITING_CALLS:
                raise ConflictError(
                    f"weight_checker: {len(self._waiting)} calls already wait for the digests "
                    "under way; call again once they have answered"
                )
            self._waiting.append(call)
            if len(self._waiting) > 1:
                return LATER
        self.updates.beside("weight-checker", self._compute)
        return LATER

    def _compute(self) -> None:
        result: Any = None
        for _ in range(3):
            commits = self.updates.commits
            try:
                result = self.updates.core.executor.collective_rpc(rank.Checksums())
            except Exception as e:
                result = e
                break
            if commits == self.updates.commits:
                break
        else:
            result = ConflictError("weight_checker: the weights changed three times while being read; call again")
        with self._lock:
            calls, self._waiting = self._waiting, []
        for waiting in calls:
            if isinstance(result, BaseException):
                self.updates.answer(waiting, error=result)
            else:
                self.updates.answer(waiting, result)
