"""The KV cache at engine start: sized on every rank from its measured profile
(worker/memory_profile.py), the smallest rank deciding, allocated, then the decode steps'
CUDA graphs captured over it."""

from __future__ import annotations

import logging
import time

import msgspec

from rlserve.config import EngineConfig
from rlserve.worker import calls as rank
from rlserve.worker.executor import Executor
from rlserve.worker.memory_profile import KVSizing

logger = logging.getLogger(__name__)


def init_kv_cache(executor: Executor, config: EngineConfig, max_model_len: int) -> KVSizing:
    """Size the KV cache on every rank (the smallest decides: a rank's shard of the KV heads
    is the same size everywhere, the memory beside it may not be), allocate it, then
    capture the decode graphs over it. Returns the sizing it was allocated by."""
    sizes = [msgspec.convert(r, KVSizing) for r in executor.collective_rpc(rank.SizeKVCache(max_model_len))]
    sizing = min(sizes, key=lambda s: s.num_blocks)
    executor.collective_rpc(rank.InitKVCache(sizing.num_blocks))
    if not config.enforce_eager:
        t = time.perf_counter()
        executor.collective_rpc(rank.CaptureCudaGraphs(config.max_num_seqs, max_model_len))
        logger.info("captured CUDA graphs in %.1fs", time.perf_counter() - t)
    return sizing
