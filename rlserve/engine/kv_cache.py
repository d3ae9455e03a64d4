"""Block pool and prefix cache for the paged KV cache.

A request owns a list of block ids; token i of the request lives in slot
`blocks[i // block_size] * block_size + i % block_size`. A block full of computed tokens is
registered under a chained hash (hash of the previous block's hash and this block's
tokens), so a later request whose prompt starts the same way reuses it. Freed blocks keep
their hash until they are reallocated, least recently freed first.

The block lists are mirrored in one 2-D array (BlockTables), kept up to date as blocks
are added and freed, which is what each step hands to the model runner.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from rlserve.engine.request import Request


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise the memory budget")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
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

    def register(self, block: int, h: int) -> None:
        if h not in self.cached:
            self.cached[h] = block
            self.block_hash[block] = h

    def reset_hashes(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks


class BlockTables:
    """Every request's block ids as one row of a 2-D array, written as blocks are added,
    so a step's block table is one gather rather than a copy of every request's list.

    Rows are padded with 0 (a released row is zeroed), as a table built from lists is.
    """

    def __init__(self, rows: int = 64, cols: int = 64):
        self.array = np.zeros((rows, cols), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self.free_rows = list(range(rows - 1, -1, -1))  # pop() takes the lowest

    def new_row(self) -> int:
        if not self.free_rows:
            rows, cols = self.array.shape
            self.array = np.concatenate([self.array, np.zeros((rows, cols), dtype=np.int32)])
            self.lengths = np.concatenate([self.lengths, np.zeros(rows, dtype=np.int64)])
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def append(self, row: int, blocks: list[int]) -> None:
        start = int(self.lengths[row])
        end = start + len(blocks)
        rows, cols = self.array.shape
        if end > cols:
            wider = np.zeros((rows, max(end, 2 * cols)), dtype=np.int32)
            wider[:, :cols] = self.array
            self.array = wider
        self.array[row, start:end] = blocks
        self.lengths[row] = end

    def release(self, row: int) -> None:
        self.array[row, :self.lengths[row]] = 0
        self.lengths[row] = 0
        self.free_rows.append(row)

    def gather(self, rows: list[int]) -> np.ndarray:
        """The tables of `rows`, as wide as the longest of them."""
        idx = np.asarray(rows, dtype=np.int64)
        width = int(self.lengths[idx].max()) if len(rows) else 0
        return self.array[idx, :width]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.blocks: dict[str, list[int]] = {}
        self.hashes: dict[str, list[int]] = {}  # chained hashes of the request's full blocks
        self.rows: dict[str, int] = {}  # request id -> its row in `tables`
        self.tables = BlockTables()
        self.prefix_hits = 0
        self.prefix_queries = 0
        # Requests whose KV predates a prefix-cache reset: never registered for reuse.
        self.uncacheable: set[str] = set()

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def _block_hash(self, parent: int | None, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens)))

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks matching the start of the request's tokens.

        At least one token is left to compute: the step that computes it yields the logits.
        """
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[int] = []
        parent = None
        for i in range(max_blocks):
            parent = self._block_hash(parent, req.token_ids[i * bs:(i + 1) * bs])
            block = self.pool.cached.get(parent)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * bs
        return hits

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and nothing changed) if full."""
        cached = cached or []
        blocks = self.blocks.get(req.request_id)
        if blocks is None:
            # First allocation: the cached prefix counts as computed.
            evictable_hits = sum(1 for b in cached if self.pool.ref_cnt[b] == 0)
            total = len(cached) * self.block_size + num_new_tokens
            need = -(-total // self.block_size) - len(cached)
            if need > self.pool.num_free - evictable_hits:
                return False
            for b in cached:
                self.pool.touch(b)
            blocks = self.blocks[req.request_id] = list(cached)
            self.hashes[req.request_id] = [self.pool.block_hash[b] for b in cached]
            row = self.rows[req.request_id] = self.tables.new_row()
            start = 0
        else:
            need = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(blocks)
            if need <= 0:
                return True
            if need > self.pool.num_free:
                return False
            row = self.rows[req.request_id]
            start = len(blocks)
        for _ in range(need):
            blocks.append(self.pool.allocate())
        self.tables.append(row, blocks[start:])
        req.kv_capacity = len(blocks) * self.block_size
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the blocks that the request has now completely computed."""
        if not self.enable_prefix_caching or req.request_id in self.uncacheable:
            return
        blocks, hashes = self.blocks[req.request_id], self.hashes[req.request_id]
        bs = self.block_size
        if req.num_computed_tokens // bs <= len(hashes):
            return  # the common case: no block filled up since the last call
        known = len(req.token_ids)
        while known and req.token_ids[known - 1] < 0:  # tokens still being sampled
            known -= 1
        num_full = min(min(req.num_computed_tokens, known) // bs, len(blocks))
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            parent = self._block_hash(parent, req.token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
            self.pool.register(blocks[i], parent)

    def free(self, req: Request) -> None:
        blocks = self.blocks.pop(req.request_id, None)
        self.hashes.pop(req.request_id, None)
        row = self.rows.pop(req.request_id, None)
        if row is not None:
            self.tables.release(row)
        req.kv_capacity = 0
        self.uncacheable.discard(req.request_id)
        # Freed last block first, so the prompt's head stays cached longest.
        for b in reversed(blocks or []):
            self.pool.free(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight update: old KV must not be reused)."""
        self.pool.reset_hashes()
        self.uncacheable.update(self.blocks)

    def block_table(self, req: Request) -> list[int]:
        return self.blocks[req.request_id]

    def block_table_array(self, reqs: list[Request]) -> np.ndarray:
        """The block tables of `reqs` as one int32 array [len(reqs), most blocks], 0-padded."""
        rows = self.rows
        return self.tables.gather([rows[r.request_id] for r in reqs])
