"""Routing replay beside the KV cache: the experts each KV slot's token went through
(enable_return_routed_experts, MoE models; rlserve/model/routed_experts.py captures them)."""

from __future__ import annotations

import numpy as np


class RouteStore:
    """Routing replay: each KV slot's routes (its token's experts at every layer), kept
    beside the KV cache as vLLM keeps them per slot, so a prefix-cache hit returns the rows
    of the tokens it skips. Held on the host, int16 where the expert ids fit (half of
    vLLM's int32), handed out as int32. A slot's rows are those of the last step that
    computed its token, so recomputed tokens (preemption) and tokens after a weight update
    carry the routes of the weights that made their KV."""

    def __init__(self, num_slots: int, num_layers: int, top_k: int, num_experts: int):
        dtype = np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32
        self.rows = np.full((num_slots, num_layers, top_k), -1, dtype=dtype)

    def record(self, slots: np.ndarray, routes: np.ndarray) -> None:
        """A step's routes: row i of `routes` is the token of KV slot `slots[i]`."""
        self.rows[slots] = routes[: len(slots)]

    def gather(self, blocks: list[int], block_size: int, num_tokens: int) -> np.ndarray:
        """The routes of a request's first `num_tokens` tokens: [num_tokens, layers, k] int32."""
        pos = np.arange(num_tokens)
        slots = np.asarray(blocks, dtype=np.int64)[pos // block_size] * block_size + pos % block_size
        return self.rows[slots].astype(np.int32)
