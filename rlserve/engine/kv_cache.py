"""The paged KV cache's manager: each request's blocks, and the prefix cache over them.

A request owns a list of block ids; token i of the request lives in slot
`blocks[i // block_size] * block_size + i % block_size`. A block full of computed tokens is
registered under a chained key (a 128-bit BLAKE2b of the previous block's key and this
block's token bytes; the first block's parent is the request's `cache_salt`, if any), so a
later request whose prompt starts the same way, with the same salt, reuses it. The blocks,
and what a registered one holds, are the BlockPool's (block_pool.py): a key only finds a
candidate, checked there against the tokens and the parent.

The block lists are mirrored in one 2-D array (BlockTables), kept up to date as blocks
are added and freed, which is what each step hands to the model runner.

A hybrid model's linear-attention layers keep a state per sequence, not per token: a hit
must also give back the state at its end. A prompt's chunks end at its save point (the end
of the last full block a request with the same prompt can hit), where the step copies the
state into the StateCache, tied to that block; a hit ends at the last block with a state,
which the request's first step copies into its own slot (docs/hybrid.md).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from rlserve.config import EngineConfig
from rlserve.engine.block_pool import BlockPool, Parent
from rlserve.engine.block_tables import BlockTables
from rlserve.engine.request import Request
from rlserve.engine.state_pool import StateCache, StatePool

if TYPE_CHECKING:
    from rlserve.engine.route_store import RouteStore
    from rlserve.sequence import ScheduledRequest, Sequence
    from rlserve.worker.executor import ModelInfo


def block_key(parent_key: bytes, token_bytes: bytes) -> bytes:
    """The prefix-cache key of a block: 128 bits over its parent's key and its tokens."""
    return hashlib.blake2b(parent_key + token_bytes, digest_size=16).digest()


def root_key(cache_salt: str | None) -> bytes:
    """The parent key of a request's first block: empty, or a key of its salt."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"rlserve-salt").digest()


class _Chain:
    """A request's registered full blocks: how many, and the last one's key and content id."""

    __slots__ = ("num_blocks", "key", "parent")

    def __init__(self, num_blocks: int, key: bytes, parent: Parent):
        self.num_blocks, self.key, self.parent = num_blocks, key, parent


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        states: StatePool | None = None,
        state_cache: StateCache | None = None,
    ):
        """`states`: a hybrid model's state slots, taken and given back with a request's
        blocks; `state_cache`: its prefix cache's states (with prefix caching)."""
        self.block_size = block_size
        self.states = states
        self.state_cache = state_cache
        # The copies of cached states the next step makes (SchedulerOutput.state_loads, _saves)
        self.state_loads: list[tuple[int, int]] = []
        self.state_saves: list[tuple[int, int]] = []
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.blocks: dict[str, list[int]] = {}
        self.chains: dict[str, _Chain] = {}  # where each request's registered blocks end
        self._pack = struct.Struct(f"<{block_size}i").pack  # a block's tokens as bytes
        self.rows: dict[str, int] = {}  # request id -> its row in `tables`
        self.tables = BlockTables()
        self.prefix_hits = 0
        self.prefix_queries = 0
        # Requests whose KV predates a prefix-cache reset: never registered for reuse.
        self.uncacheable: set[str] = set()
        self.routes: RouteStore | None = None  # enable_return_routed_experts, MoE models

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks matching the start of the request's tokens.

        At least one token is left to compute: the step that computes it yields the logits.
        """
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        bs, pool, pack, tokens = self.block_size, self.pool, self._pack, req.token_ids
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[int] = []
        key = root_key(req.cache_salt)
        parent: Parent = req.cache_salt
        for i in range(max_blocks):
            token_bytes = pack(*tokens[i * bs : (i + 1) * bs])
            key = block_key(key, token_bytes)
            block = pool.lookup(key, token_bytes, parent)
            if block is None:
                break
            hits.append(block)
            parent = pool.content_id[block]
        if self.state_cache is not None:  # a hybrid model's hit ends where a state was kept
            while hits and hits[-1] not in self.state_cache:
                hits.pop()
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
            if self.states is not None:
                slot = self.states.allocate()
                if slot is None:
                    return False
                req.state_slot = slot
                if cached and self.state_cache is not None:
                    cached_slot = self.state_cache.slot(cached[-1])
                    assert cached_slot is not None  # find_cached_prefix ends hits at a kept state
                    self.state_loads.append((cached_slot, slot))
            for b in cached:
                self.pool.touch(b)
            blocks = self.blocks[req.request_id] = list(cached)
            if cached:
                last = cached[-1]
                last_key = self.pool.block_hash[last]
                assert last_key is not None  # a prefix-cache hit is a registered block
                chain = _Chain(len(cached), last_key, self.pool.content_id[last])
            else:
                chain = _Chain(0, root_key(req.cache_salt), req.cache_salt)
            self.chains[req.request_id] = chain
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
            block = self.pool.allocate()
            if self.state_cache is not None:
                self.state_cache.drop(block)  # an evicted block's state goes with it
            blocks.append(block)
        self.tables.append(row, blocks[start:])
        req.kv_capacity = len(blocks) * self.block_size
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the blocks that the request has now completely computed."""
        if not self.enable_prefix_caching or req.request_id in self.uncacheable:
            return
        chain = self.chains[req.request_id]
        bs = self.block_size
        if req.num_computed_tokens // bs <= chain.num_blocks:
            return  # the common case: no block filled up since the last call
        blocks, tokens = self.blocks[req.request_id], req.token_ids
        known = len(tokens)
        while known and tokens[known - 1] < 0:  # tokens still being sampled
            known -= 1
        num_full = min(min(req.num_computed_tokens, known) // bs, len(blocks))
        key, parent, pack, register = chain.key, chain.parent, self._pack, self.pool.register
        states = self.state_cache
        for i in range(chain.num_blocks, num_full):
            token_bytes = pack(*tokens[i * bs : (i + 1) * bs])
            key = block_key(key, token_bytes)
            parent = register(blocks[i], key, token_bytes, parent)
            if states is not None and blocks[i] in states:
                self._settle_state(blocks[i], key, parent)
        if num_full > chain.num_blocks:
            chain.num_blocks, chain.key, chain.parent = num_full, key, parent

    def _settle_state(self, block: int, key: bytes, content_id: int) -> None:
        """A state was saved at the end of `block`, just registered: it stays there if the
        cache serves this block; moves to the block it serves for the same contents if that
        has none; else it is not needed."""
        assert self.state_cache is not None
        served = self.pool.cached.get(key)
        if served == block:
            return
        if served is not None and self.pool.content_id[served] == content_id and served not in self.state_cache:
            self.state_cache.move(block, served)
        else:
            self.state_cache.drop(block)

    def state_chunk(self, req: Request, start: int, n: int) -> int:
        """A hybrid model's prompt chunk from `start` ends at the request's save point if it
        would pass it (the step then saves the state there)."""
        point = (req.num_prompt_tokens - 1) // self.block_size * self.block_size
        return point - start if start < point < start + n else n

    def save_state(self, req: Request, start: int, n: int) -> None:
        """Have the step save the request's state if its chunk ends at the save point."""
        assert self.state_cache is not None
        bs = self.block_size
        point = (req.num_prompt_tokens - 1) // bs * bs
        if start + n != point or point == 0 or req.request_id in self.uncacheable:
            return
        block = self.blocks[req.request_id][point // bs - 1]
        if block not in self.state_cache:
            self.state_saves.append((req.state_slot, self.state_cache.attach(block)))

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The state copies the step being scheduled makes: (loads, saves)."""
        copies = self.state_loads, self.state_saves
        self.state_loads, self.state_saves = [], []
        return copies

    def free(self, req: Request) -> None:
        blocks = self.blocks.pop(req.request_id, None)
        self.chains.pop(req.request_id, None)
        row = self.rows.pop(req.request_id, None)
        if row is not None:
            self.tables.release(row)
        req.kv_capacity = 0
        self.uncacheable.discard(req.request_id)
        if self.states is not None and req.state_slot >= 0:
            self.states.free(req.state_slot)
            req.state_slot = -1
        # Freed last block first, so the prompt's head stays cached longest.
        for b in reversed(blocks or []):
            self.pool.free(b)
            if self.state_cache is not None and self.pool.block_hash[b] is None:
                self.state_cache.drop(b)  # never registered (uncacheable): nothing can hit it

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight update: old KV must not be reused)."""
        self.pool.reset_hashes()
        self.uncacheable.update(self.blocks)
        if self.state_cache is not None:
            self.state_cache.clear()

    def block_table(self, req: Sequence) -> list[int]:
        return self.blocks[req.request_id]

    def step_slots(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """The KV slot of every token of a step about to launch (ScheduledRequest items, in
        row order; their num_computed_tokens not yet advanced): where its routes go."""
        n = len(scheduled)
        counts = np.fromiter((it.num_new_tokens for it in scheduled), dtype=np.int64, count=n)
        starts = np.fromiter((it.request.num_computed_tokens for it in scheduled), dtype=np.int64, count=n)
        tables = self.block_table_array([it.request for it in scheduled])
        rows = np.repeat(np.arange(n), counts)
        pos = np.arange(int(counts.sum())) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
        bs = self.block_size
        return tables[rows, pos // bs].astype(np.int64) * bs + pos % bs

    def routes_of(self, req: Request) -> np.ndarray | None:
        """A request's routes as vLLM returns them: a row for every token that went through
        the model, i.e. every token but the last sampled one; None where they are not all
        known (it ended before its first token, or while preempted)."""
        blocks = self.blocks.get(req.request_id)
        if self.routes is None or blocks is None or not req.token_versions:
            return None
        return self.routes.gather(blocks, self.block_size, req.num_prompt_tokens + len(req.token_versions) - 1)

    def block_table_array(self, reqs: Iterable[Sequence]) -> np.ndarray:
        """The block tables of `reqs` as one int32 array [len(reqs), most blocks], 0-padded."""
        rows = self.rows
        return self.tables.gather([rows[r.request_id] for r in reqs])


def kv_manager(model: ModelInfo, num_blocks: int, config: EngineConfig) -> KVCacheManager:
    """The block pool, and a hybrid model's state slots beside it: a slot per running
    sequence, then the prefix cache's (EngineConfig.state_cache_slots)."""
    if not model.hybrid:
        return KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
    cache = StateCache(config.max_num_seqs, config.state_cache_slots) if config.state_cache_slots else None
    return KVCacheManager(
        num_blocks, config.block_size, config.enable_prefix_caching, StatePool(config.max_num_seqs), cache
    )
