"""The GPU suite runs in shards side by side on one device (scripts/gpu_check.sh suite), and an
engine sizes its KV cache from the device's free memory: each test gives back the memory its
process's allocator keeps cached, so one shard's kernel tests do not starve another's engines."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _give_back_cached_memory():
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
