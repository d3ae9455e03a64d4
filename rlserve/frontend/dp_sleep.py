"""Sleep across data-parallel replicas, answered as one engine would (vLLM's semantics).

Each replica's engine keeps its own per-tag state (engine/sleep.py: "weights", "kv_cache",
or "scheduling" for a level-0 sleep); together they sleep while any replica has any tag
asleep. The front end records what they sleep with after every /sleep, /wake_up and
/release_kv_cache_memory (from the replicas themselves, so a partial wake is never taken
for a whole one), and a replica that (re)starts meanwhile is put in the same state: it
neither serves while the others sleep nor holds the memory they gave back. Its weights
are copied from a serving replica (dp_weights.py) only while the weights are awake.
"""

from __future__ import annotations

from typing import Any, Protocol

from rlserve.frontend.dp_replica import Replica
from rlserve.wire.messages import AnyControlCall, ReleaseKVCache, Sleep, WakeUp
from rlserve.wire.outputs import EngineStats

TAGS = ("weights", "kv_cache")  # what a level-1 or level-2 sleep puts to sleep


class Front(Protocol):
    """What the sleep state reads of the front end (DPEngineClient)."""

    async def fan_out(self, body: AnyControlCall) -> dict[int, Any]: ...

    async def stats(self) -> EngineStats: ...

    async def stats_of(self, r: Replica) -> EngineStats: ...


class ReplicaSleep:
    def __init__(self, front: Front):
        self.front = front
        self.asleep: frozenset[str] = frozenset()  # the union of the replicas' sleeping tags
        self.level = 0  # the deepest replica's sleep level (0: awake, or a level-0 sleep)

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)

    @property
    def weights_asleep(self) -> bool:
        return "weights" in self.asleep

    async def call(self, body: Sleep | WakeUp | ReleaseKVCache) -> Any:
        """The call on every live replica; then what they sleep with, together."""
        if isinstance(body, Sleep):  # a replica that starts meanwhile sleeps too
            self.asleep = self.asleep | (frozenset(TAGS) if body.level else {"scheduling"})
            self.level = max(self.level, body.level)
        try:
            values = list((await self.front.fan_out(body)).values())
        finally:
            await self.record()
        return values[0] if values else None

    async def record(self) -> None:
        try:
            stats = await self.front.stats()
        except Exception:
            return  # no replica answers: the next call records
        self.asleep, self.level = frozenset(stats.asleep), stats.sleep_level

    async def match(self, r: Replica) -> None:
        """Bring replica r (started awake) to the state the others sleep in."""
        want = self.asleep
        have = frozenset((await self.front.stats_of(r)).asleep)
        if have == want:
            return
        if not want:
            await r.client.call(WakeUp(None))
        elif want == {"scheduling"}:
            await r.client.call(Sleep(0))
        else:
            await r.client.call(Sleep(max(self.level, 1)))  # every tag asleep, as deep as the others
            awake = [t for t in TAGS if t not in want]
            if awake:
                await r.client.call(WakeUp(awake))
