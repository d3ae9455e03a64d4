"""The pool of KV-cache blocks: reference counts, the free queue, and what each block the
prefix cache registered holds.

A block is shared by every running request that uses it (its reference count); at 0 it
joins the free queue, still holding its cached contents, and keeps them until it is
reallocated, least recently freed first. A registered block is found by its key
(engine/kv_cache.py computes the chained keys), but a key only finds a candidate: a hit is
served only if the block holds the same tokens and was computed after the very block (or
salt) the request's previous hit is, so even a collision of keys never serves another
prompt's KV cache.
"""

from __future__ import annotations

from collections import OrderedDict

# What a cached block was computed after: the id of its parent block's contents (an int,
# see BlockPool.content_id), or for a request's first block its salt (None: no salt).
Parent = int | str | None


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise the memory budget")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> block id
        # What each registered block holds, checked on every hit: its token bytes, what it
        # was computed after, and an id for its contents that its children name as parent.
        self.block_tokens: list[bytes | None] = [None] * num_blocks
        self.block_parent: list[Parent] = [None] * num_blocks
        self.content_id: list[int] = [0] * num_blocks
        self._next_content_id = 1
        # Blocks with ref_cnt 0, in eviction order (oldest first).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict its cached contents
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            self.block_tokens[block] = None
            self.content_id[block] = 0  # its cached children can no longer match
        self.ref_cnt[block] = 1
        return block

    def touch(self, block: int) -> None:
        if self.ref_cnt[block] == 0:
            del self.free_queue[block]
        self.ref_cnt[block] += 1

    def free(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free_queue[block] = None

    def lookup(self, key: bytes, token_bytes: bytes, parent: Parent) -> int | None:
        """The cached block under `key` if it holds `token_bytes` computed after `parent`."""
        block = self.cached.get(key)
        if block is None or self.block_tokens[block] != token_bytes or self.block_parent[block] != parent:
            return None
        return block

    def register(self, block: int, key: bytes, token_bytes: bytes, parent: Parent) -> int:
        """Cache `block`'s contents under `key`; the id its children name as their parent.

        A key already cached for the same contents keeps the first block, and the id is that
        block's (so later hits chain through it). A key cached for other contents (a
        collision) leaves the cache as it is: the block gets an id no cached block has.
        """
        other = self.cached.get(key)
        if other is not None and self.block_tokens[other] == token_bytes and self.block_parent[other] == parent:
            return self.content_id[other]
        cid = self._next_content_id
        self._next_content_id += 1
        if other is None:
            self.cached[key] = block
            self.block_hash[block] = key
            self.block_tokens[block] = token_bytes
            self.block_parent[block] = parent
            self.content_id[block] = cid
        return cid

    def reset_hashes(self) -> None:
        # Only registered blocks carry a key (each is its key's entry in `cached`): the
        # cost is the cache's size, not the pool's (tens of thousands of blocks on a GPU).
        for block in self.cached.values():
            self.block_hash[block] = None
            self.block_tokens[block] = None
            self.content_id[block] = 0
        self.cached.clear()
