"""Sleep mode: the device memory given back (level 1: weights and KV cache; level 2: the
weights dropped; level 0: scheduling stopped only), the KV cache alone released, and wake-up
by tags. Whether the engine sleeps is EngineState's (state.py); EngineCore (core.py) takes
these methods as a mixin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlserve.engine.kv_cache import KVCacheManager
from rlserve.engine.scheduler import Scheduler
from rlserve.engine.state import EngineState
from rlserve.errors import ConflictError
from rlserve.sampling_params import InvalidRequestError
from rlserve.wire.outputs import EngineCoreOutputs
from rlserve.worker import calls as rank
from rlserve.worker.executor import Executor


class EngineSleep:
    # EngineCore's (core.py), changed here.
    state: EngineState
    scheduler: Scheduler
    kv: KVCacheManager
    executor: Executor

    if TYPE_CHECKING:

        def _process_inflight(self) -> EngineCoreOutputs | None: ...

    def sleep(self, level: int = 1) -> EngineCoreOutputs | None:
        """Give the device memory back (see Worker.sleep). Running requests keep their
        tokens and recompute their KV after wake-up; requests that arrive meanwhile wait.
        Level 2 drops the weights: nothing runs again until a full update arrives (the
        caller ends the requests in flight first). Level 0, as vLLM's, only stops
        scheduling: nothing is given back."""
        if level not in (0, 1, 2):
            raise InvalidRequestError(f"level: must be 0, 1 or 2, got {level!r}", "level")
        state = self.state
        if state.sleeping and (level == 0 or (state.weights_asleep and (level == 1 or state.no_weights))):
            return None  # as deep already
        # Deeper than now: from level 0, from weights woken alone, or level 1 to 2.
        outputs = self._process_inflight()
        state.sleeping = True
        if level == 0:
            state.asleep = frozenset({"scheduling"})
            return outputs
        for req in reversed(list(self.scheduler.running)):  # keeps their order in the queue
            self.scheduler.drop_kv(req)
        self.kv.reset_prefix_cache()
        self.executor.collective_rpc(rank.Sleep(level))
        state.asleep = frozenset({"weights", "kv_cache"})
        if level == 2:
            state.no_weights = True
        return outputs

    def release_kv_cache(self) -> EngineCoreOutputs | None:
        """Give the KV cache back, the weights kept (vLLM's release_kv_cache_memory): the
        requests in flight keep their tokens and recompute after /wake_up (tags kv_cache)."""
        if self.state.sleeping:
            asleep = ", ".join(sorted(self.state.asleep))
            raise ConflictError(
                f"release_kv_cache_memory: the engine is asleep already ({asleep}); POST /wake_up first"
            )
        outputs = self._process_inflight()
        for req in reversed(list(self.scheduler.running)):
            self.scheduler.drop_kv(req)
        self.kv.reset_prefix_cache()
        self.executor.collective_rpc(rank.ReleaseKVCache())
        self.state.asleep = frozenset({"kv_cache"})
        self.state.sleeping = True
        return outputs

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake what `tags` names ("weights", "kv_cache"; None: everything). The engine
        sleeps until everything is awake: an RL loop wakes the weights, updates them, then
        wakes the KV cache (vLLM's order)."""
        wanted = set(tags) if tags else {"weights", "kv_cache", "scheduling"}
        unknown = sorted(wanted - {"weights", "kv_cache", "scheduling"})
        if unknown:
            raise InvalidRequestError(
                f"tags: unknown tag(s) {', '.join(map(repr, unknown))} (known: 'weights', 'kv_cache')", "tags"
            )
        state = self.state
        waking = sorted(state.asleep & wanted - {"scheduling"})
        if waking:
            self.executor.collective_rpc(rank.WakeUp(waking))
        state.asleep = frozenset(state.asleep - wanted - {"scheduling"})  # any wake ends a level-0 sleep
        state.sleeping = bool(state.asleep)
