"""A rank's device memory as measured at start (rlserve/worker/memory_profile.py measures
it): logged, sent to the API server with the engine's EngineReady, and served on /metrics."""

from __future__ import annotations

import msgspec

GiB = 1 << 30


class MemoryProfile(msgspec.Struct, array_like=True, frozen=True):
    """One rank's device memory, in bytes, as measured before the KV cache is allocated."""

    total: int  # the device's memory
    free: int  # free on the device once profiling has given its memory back
    weights: int  # what the allocator holds with the model loaded (weights, LoRA slots, buffers)
    activations: int  # peak allocation above `weights` during the worst steps
    cuda_graphs: int  # the decode graphs' memory pool (0: eager)
    non_torch: int  # growth outside the allocator while profiling (CUDA, cuBLAS, NCCL workspaces)
    kv_cache: int = 0  # the KV cache's bytes, once sized

    @property
    def non_kv(self) -> int:
        return self.weights + self.activations + self.cuda_graphs + self.non_torch

    def describe(self, kv_tokens: int) -> str:
        parts = (("weights", self.weights), ("peak activations", self.activations),
                 ("CUDA graphs", self.cuda_graphs), ("non-torch", self.non_torch), ("KV cache", self.kv_cache))
        return ", ".join(f"{name} {b / GiB:.2f} GiB" for name, b in parts) + f" = {kv_tokens} tokens"
