"""One model worker (one tensor-parallel rank): device, model, KV cache, weight loading.
Live updates from a trainer go through its WeightReceiver (weight_receiver.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec
import torch

from rlserve.config import EngineConfig, resolve_dtype, resolve_kv_cache_dtype
from rlserve.distributed import TPGroup, tp_device, tp_group_scope
from rlserve.model.loader import build_model
from rlserve.model.peft import LoRAConfig, pair_tensors
from rlserve.worker.memory_profile import (
    KVSizing,
    WorstSteps,
    kv_cache_blocks,
    kv_cache_budget,
    profile_memory,
)
from rlserve.worker.model_runner import ModelRunner
from rlserve.worker.weight_receiver import WeightReceiver

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rlserve.model.lora import LoRAModel

logger = logging.getLogger(__name__)

_CPU_KV_DEFAULT_BYTES = 1 << 30


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: PretrainedConfig,
        model_path: str,
        rank: int = 0,
        tp: TPGroup | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.tp = tp or TPGroup()
        device = config.device if self.tp.world_size == 1 else tp_device(config.device, rank)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(config.dtype, config.device, getattr(hf_config, "torch_dtype", None))
        t0 = time.perf_counter()
        torch.manual_seed(config.seed)
        with tp_group_scope(self.tp):  # the layers take their shard of the model from it
            self.model = build_model(
                hf_config, self.dtype, str(self.device), config.load_format, model_path, seed=config.seed
            )
        if config.load_format == "dummy" and self.tp.world_size > 1:
            self._init_dummy_unsharded(config.seed)
        self.lora: LoRAModel | None = None
        if config.enable_lora:
            from rlserve.model.lora import attach_lora

            self.lora = attach_lora(self.model, config.max_loras, config.max_lora_rank)
        self.load_seconds = time.perf_counter() - t0
        self.runner = ModelRunner(
            self.model,
            self.device,
            self.dtype,
            config.block_size,
            config.logprobs_mode,
            lora=self.lora,
            kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype),
            batch_invariant=config.batch_invariant,
            tp=self.tp,
        )
        if config.enable_return_routed_experts and self.rank == 0:
            # Rank 0 alone: every rank routes alike (the router is replicated), one copy is returned.
            self.runner.capture_routes(max(config.max_num_batched_tokens, min(config.max_num_seqs, 512)))
        self._param_shapes = {n: p.shape for n, p in self.model.named_parameters()}
        self._host_weights: dict[str, torch.Tensor] = {}  # level-1 sleep: the weights in host memory
        self.receiver = WeightReceiver(self.model, self.device, self.dtype, self.lora, rank)

    @torch.no_grad()
    def _init_dummy_unsharded(self, seed: int) -> None:
        """Redraw dummy weights at full size and keep this rank's shard, so every
        tensor-parallel size serves the same dummy model (and replicated parameters agree
        across ranks). Same draws as the loader's init_dummy_weights on one rank."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for p in self.model.full_parameters():
            buf = torch.empty(p.shape, dtype=torch.float32, device=self.device)
            buf.uniform_(-1e-3, 1e-3, generator=gen)
            self.model.load_weights((name, buf.narrow(p.dim, start, size)) for name, start, size in p.pieces)

    # -- KV cache sizing ---------------------------------------------------------------
    def size_kv_cache(self, max_model_len: int) -> KVSizing:
        """The KV cache's blocks: fixed by the config, or what the budget holds; on a GPU the
        budget is measured (memory_profile.py)."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return KVSizing(cfg.num_kv_blocks)
        per_block = self.runner.kv_bytes_per_block()
        # A hybrid model's state pool (a slot per sequence, the prefix cache's, and the decode
        # graphs' padding slot) comes out of the same budget.
        states = (cfg.max_num_seqs + cfg.state_cache_slots + 1) * self.runner.state_bytes_per_sequence()
        if cfg.kv_cache_memory_bytes is not None:
            return KVSizing(kv_cache_blocks(cfg.kv_cache_memory_bytes - states, per_block))
        if self.device.type != "cuda":
            return KVSizing(kv_cache_blocks(_CPU_KV_DEFAULT_BYTES - states, per_block))
        limits = WorstSteps(
            cfg.max_num_batched_tokens,
            cfg.max_num_seqs,
            max_model_len,
            cfg.max_logprobs,
            capture_graphs=not cfg.enforce_eager,
        )
        profile = profile_memory(self.runner, limits)
        num_blocks = kv_cache_blocks(kv_cache_budget(profile, cfg.gpu_memory_utilization) - states, per_block)
        return KVSizing(num_blocks, msgspec.structs.replace(profile, kv_cache=num_blocks * per_block))

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.allocate_states(self.config.max_num_seqs + self.config.state_cache_slots)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        self.runner.capture_cuda_graphs(max_num_seqs, max_model_len)
        self._graph_args = (max_num_seqs, max_model_len)

    # -- sleep / wake --------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Give the device memory back: the KV cache and CUDA graphs always; the weights
        move to host memory (level 1) or are dropped (level 2: the next update must send
        them all). Again while asleep, it only deepens (level 2 drops the host copy)."""
        self.receiver.forget_storage()
        if self.runner.kv_cache is not None:
            self._kv_blocks = self.runner.num_blocks
            self.runner.free_kv_cache()
        if level == 2:
            self._host_weights = {}
        for name, p in self.model.named_parameters():  # tied weights appear once
            if p.numel() == 0:
                continue  # asleep already
            if level == 1:
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.device.type == "cuda")
                host.copy_(p.data)
                self._host_weights[name] = host
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release_kv_cache(self) -> None:
        """The KV cache's memory back, the weights kept (wake_up's "kv_cache" restores it)."""
        if self.runner.kv_cache is not None:
            self._kv_blocks = self.runner.num_blocks
            self.runner.free_kv_cache()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Give back what `tags` names ("weights", "kv_cache"; None: both). CUDA graphs
        are captured again once both are back."""
        tags = tags or ["weights", "kv_cache"]
        self.receiver.forget_storage()
        if "weights" in tags:
            for name, p in self.model.named_parameters():
                if p.numel() or not self._param_shapes[name].numel():
                    continue  # awake already
                host = self._host_weights.get(name)
                if host is not None:
                    p.data = host.to(self.device, non_blocking=True)
                else:  # level 2: storage comes back uninitialised until the next update
                    p.data = torch.empty(self._param_shapes[name], dtype=p.dtype, device=self.device)
            self._host_weights = {}
        if "kv_cache" in tags and self.runner.kv_cache is None:
            self.runner.allocate_kv_cache(self._kv_blocks)
            self.runner.allocate_states(self.config.max_num_seqs + self.config.state_cache_slots)
        weights_back = all(p.numel() or not self._param_shapes[n].numel() for n, p in self.model.named_parameters())
        if weights_back and self.runner.kv_cache is not None and getattr(self, "_graph_args", None) is not None:
            self.runner.capture_cuda_graphs(*self._graph_args)

    # -- weights -----------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.model.load_weights(weights)

    # -- LoRA adapters -------------------------------------------------------------------
    def load_lora(self, tensors: list[tuple[str, torch.Tensor]], name: str, slot: int | None, config: dict) -> None:
        """Put an adapter's full PEFT tensors (this rank keeps its shards) in its host copy,
        and in `slot` if given."""
        lora = self._adapters()
        cfg = LoRAConfig.parse(config, "adapter_config", lora.max_rank)
        lora.load(name, pair_tensors(tensors, cfg, "adapter"), cfg.scaling)
        if slot is not None:
            self.swap_lora(slot, None, name)

    def swap_lora(self, slot: int, save: str | None, restore: str | None) -> None:
        if save is not None:
            self._adapters().save(slot, save)
        if restore is not None:
            self._adapters().restore(restore, slot)
            self.receiver.forget_plan(slot)  # the slot holds another adapter now

    def remove_lora(self, slot: int | None, name: str | None = None) -> None:
        if slot is not None:
            self._adapters().clear(slot)
            self.receiver.forget_plan(slot)
        if name is not None:
            self._adapters().drop(name)
            self.receiver.forget_adapter(name)

    def _adapters(self) -> LoRAModel:
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this server (--enable-lora)")
        return self.lora
