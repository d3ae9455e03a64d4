"""State slots of a hybrid model's running sequences, beside the KV block pool.

A linear-attention layer (rlserve/model/gated_deltanet.py) keeps one conv state and one
recurrent state per running sequence instead of paged keys and values; the worker holds
one pool of them per layer, `num_slots` deep (max_num_seqs). A request takes a slot with
its first KV blocks and gives it back with them (KVCacheManager.allocate / free): when it
finishes, and when it is preempted, so a preempted request is recomputed from its prompt
into whatever slot it gets next (a chunk that starts at position 0 starts from zero state).
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"state pool: needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is taken."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state pool: slot {slot} is not in use")
        self._free.append(slot)

