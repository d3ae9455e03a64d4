"""State slots of a hybrid model, beside the KV block pool: its running sequences' states,
and the prefix cache's.

A linear-attention layer (rlserve/model/gated_deltanet.py) keeps one conv state and one
recurrent state per running sequence instead of paged keys and values; the worker holds
one pool of them per layer: `max_num_seqs` slots for running sequences (StatePool), then,
with prefix caching, as many again for states the prefix cache keeps (StateCache).

A request takes a running slot with its first KV blocks and gives it back with them
(KVCacheManager.allocate / free): when it finishes, and when it is preempted, so a
preempted request is recomputed from its prompt, or from a cached state, into whatever
slot it gets next (a chunk that starts at position 0 starts from zero state).

A cached state is what a prompt's tokens leave at the end of one full block: a later
prompt that starts with the same blocks copies it into its running slot and computes only
the rest (docs/hybrid.md says which boundary is kept, and why).
"""

from __future__ import annotations

from collections import OrderedDict


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


class StateCache:
    """The states the prefix cache keeps, each tied to the KV block it ends: slots
    `first_slot` .. `first_slot + num_slots - 1` of the worker's pool.

    A state goes with its block (the block is evicted, or the cache reset), or, when a new
    state needs a slot and none is free, the least recently used goes. A step copies a
    cached state out before its forward pass and into the cache after it, so a slot taken
    over in a step is still read in that step before it is written.
    """

    def __init__(self, first_slot: int, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"state cache: needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._slots: OrderedDict[int, int] = OrderedDict()  # block -> slot, least recently used first

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block: int) -> bool:
        return block in self._slots

    def slot(self, block: int) -> int | None:
        """The slot of the state at the end of `block`, marked used; None if none is kept."""
        slot = self._slots.get(block)
        if slot is not None:
            self._slots.move_to_end(block)
        return slot

    def attach(self, block: int) -> int:
        """A slot for the state at the end of `block` (a free one, else the least recently
        used one's)."""
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slots.popitem(last=False)
        self._slots[block] = slot
        return slot

    def move(self, block: int, to: int) -> None:
        """`block`'s state now ends `to` (a block with the same contents, the one the prefix
        cache serves)."""
        self._slots[to] = self._slots.pop(block)

    def drop(self, block: int) -> None:
        slot = self._slots.pop(block, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        self._free.extend(self._slots.values())
        self._slots.clear()
