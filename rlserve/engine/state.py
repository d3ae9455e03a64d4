"""Whether the engine may step now: the pause, the sleep, and the weights' presence, in one
place. EngineCore owns it and changes it (pause, resume, sleep, wake, a weight update);
the scheduler reads `stopped`, and the engine-core process (core_proc.py) answers the
pause(wait) calls kept in `waits` once `EngineCore.settled_waits` says they hold.
"""

from __future__ import annotations

from typing import Any

from rlserve.sampling_params import InvalidRequestError

PAUSE_MODES = ("abort", "wait", "keep")


class EngineState:
    def __init__(self) -> None:
        self.paused = False
        self.pause_mode: str | None = None  # one of PAUSE_MODES while paused
        # Requests held in place by a `keep` pause: they keep their KV but are not stepped.
        self.frozen = False
        self.sleeping = False  # the device memory is given back (or, level 0, scheduling stops)
        self.asleep: frozenset[str] = frozenset()  # what sleeps: "weights", "kv_cache" (level 0: "scheduling")
        # The weights are not worth serving (a level-2 sleep dropped them, or noise replaced
        # them): nothing runs until a complete update.
        self.no_weights = False
        self.waits: list[Any] = []  # pause(wait) calls (messages.Call), answered once they hold

    @property
    def stopped(self) -> bool:
        """No step may run: frozen, asleep, or without weights."""
        return self.frozen or self.sleeping or self.no_weights

    @property
    def weights_asleep(self) -> bool:
        return "weights" in self.asleep

    @property
    def refuses_new_requests(self) -> bool:
        """A pause that ends the requests in flight is a boundary: what arrives after it is
        answered at once (vLLM's 503), not run later on other weights. A keep pause holds
        new requests with the frozen ones until /resume."""
        return self.paused and self.pause_mode in ("abort", "wait")

    def pause(self, mode: str) -> None:
        self.paused = True
        self.pause_mode = mode
        self.frozen = mode == "keep"

    def resume(self) -> None:
        self.paused = False
        self.pause_mode = None
        self.frozen = False

    @property
    def sleep_level(self) -> int:
        return (2 if self.no_weights else 1) if self.sleeping else 0


def asleep_refusal(state: EngineState) -> InvalidRequestError | None:
    """The one rule for an asleep engine and a weight update: wake the weights first (their
    storage is given back); the KV cache may stay asleep (vLLM's /wake_up?tags=weights,
    update, then kv_cache)."""
    if state.weights_asleep:
        return InvalidRequestError(
            "the server's weights are asleep: POST /wake_up (or /wake_up?tags=weights) before updating weights",
            "update_info",
        )
    return None
