"""Pausing generation: the three modes (abort, keep, wait), the pause(wait) calls answered
once they hold, and resume. Whether the engine is paused is EngineState's (state.py);
EngineCore (core.py) takes these methods as a mixin."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rlserve.engine.kv_cache import KVCacheManager
from rlserve.engine.request import Request
from rlserve.engine.scheduler import Scheduler
from rlserve.engine.state import PAUSE_MODES, EngineState
from rlserve.errors import ConflictError
from rlserve.sampling_params import InvalidRequestError
from rlserve.wire.control import Paused
from rlserve.wire.outputs import Finished


class EnginePause:
    # EngineCore's (core.py), changed here.
    state: EngineState
    scheduler: Scheduler
    kv: KVCacheManager
    held: list[Request]

    if TYPE_CHECKING:

        def abort(self, request_ids: Iterable[str]) -> list[Finished]: ...
        def has_unfinished(self) -> bool: ...
        def unfinished_ids(self) -> list[str]: ...
        def reset_prefix_cache(self) -> None: ...

    def pause(self, mode: str = "abort", clear_cache: bool = False) -> list[Finished]:
        """Stop producing tokens. `abort` ends in-flight requests now; `keep` freezes them
        with their KV cache; `wait` lets them run on (the caller waits for `drained`).
        A later pause replaces the mode of an earlier one, except `wait` after `keep`
        with requests frozen: refused (ConflictError) at once, since draining them would
        first resume what the keep-pause froze, and its caller would wait as long as they
        run."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
        if mode == "wait" and self.state.pause_mode == "keep" and self.has_unfinished():
            from rlserve.wire.messages import ConflictError

            raise ConflictError(
                f"mode: wait: generation is paused with mode keep and {len(self.unfinished_ids())} "
                "requests are frozen, so waiting for them would never end; POST /resume first "
                "(then /pause?mode=wait drains them), or /pause?mode=abort to end them"
            )
        self.state.pause(mode)
        outputs: list[Finished] = []
        if mode == "abort":
            outputs = self.abort(self.unfinished_ids())
            if clear_cache:  # keep: below; wait: once drained (settled_waits)
                self.kv.reset_prefix_cache()
        elif mode == "keep" and clear_cache:
            for req in reversed(list(self.scheduler.running)):
                self.scheduler.drop_kv(req)
            self.kv.reset_prefix_cache()
        return outputs

    @property
    def drained(self) -> bool:
        """Every request that was in flight when generation was paused has finished."""
        return not self.has_unfinished()

    def settled_waits(self) -> list[tuple[Any, Paused | ConflictError]]:
        """The pause(wait) calls (state.waits) whose condition holds now, each with its
        answer; they leave `waits`. One holds once the requests in flight have finished, or
        can no longer run (a later keep-pause, or sleep: they are kept, and the answer says
        so), or generation was resumed meanwhile (an error)."""
        state = self.state
        settled: list[tuple[Any, Paused | ConflictError]] = []
        for call in list(state.waits):
            answer: Paused | ConflictError
            if not state.paused:
                answer = ConflictError("mode: generation was resumed before the requests in flight finished")
            elif self.drained:
                if call.body.clear_cache:
                    self.reset_prefix_cache()
                answer = Paused("wait")
            elif state.pause_mode == "keep" or state.sleeping:
                answer = Paused("keep", self.scheduler.num_unfinished)
            else:
                continue
            state.waits.remove(call)
            settled.append((call, answer))
        return settled

    def resume(self) -> None:
        self.state.resume()
        for req in self.held:
            self.scheduler.add(req)
        self.held.clear()
