"""One model worker (one tensor-parallel rank): device, model, KV cache, weight loading."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np
import torch

from rlserve.config import EngineConfig, resolve_dtype, resolve_kv_cache_dtype
from rlserve.distributed import TPGroup, tp_device, tp_group_scope
from rlserve.model.loader import build_model
from rlserve.model.peft import LoRAConfig, pair_tensors, peft_name
from rlserve.sequence import SchedulerOutput
from rlserve.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)

_CPU_KV_DEFAULT_BYTES = 1 << 30


class Worker:
    def __init__(self, config: EngineConfig, hf_config, model_path: str, rank: int = 0,
                 tp: TPGroup | None = None):
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
            self.model = build_model(hf_config, self.dtype, str(self.device), config.load_format,
                                     model_path, seed=config.seed)
        if config.load_format == "dummy" and self.tp.world_size > 1:
            self._init_dummy_unsharded(config.seed)
        self.lora = None
        if config.enable_lora:
            from rlserve.model.lora import attach_lora
            self.lora = attach_lora(self.model, config.max_loras, config.max_lora_rank)
        self.load_seconds = time.perf_counter() - t0
        self.runner = ModelRunner(self.model, self.device, self.dtype, config.block_size,
                                  config.logprobs_mode, lora=self.lora,
                                  kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype))
        self._param_shapes = {n: p.shape for n, p in self.model.named_parameters()}
        # Taken while the parameters have their real shapes (sleep empties them).
        self.expected = self.model.expected_weights()
        self._update_expected = None  # what an update is checked against (receive_weights)
        self.ipc_receiver = None
        self._ipc_plan = None
        self.lora_ipc_receivers: dict = {}  # adapter name -> its own IPCReceiver (handles stay open)
        self._lora_plans: dict = {}  # slot -> (staged tensors, LoRAConfig, LoadPlan) of its last update
        self._lora_expected_memo = None  # (wire config, what _lora_expected made of it)
        self.transfer_group = None
        self.staged = None
        self.staged_lora = None  # the LoRAConfig of a staged adapter update
        self._connecting = None  # a transfer group whose init is under way (abortable)
        self._transfer_lock = threading.Lock()  # one receive (or refusal) at a time

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
    def determine_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.runner.kv_bytes_per_block()
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # gpu_memory_utilization is this server's share of the device (as in vLLM), so
            # other processes on the GPU (a colocated trainer) do not count against it;
            # what is actually free still caps it.
            ours = torch.cuda.memory_reserved(self.device)
            # Room for activations of the largest step; the rest of the share is KV cache.
            hf = self.model.config
            activations = cfg.max_num_batched_tokens * self.model.activation_width() * self.dtype.itemsize * 4
            logits = cfg.max_num_seqs * hf.vocab_size * 4 * 4
            reserve = activations + logits + (1 << 30)
            budget = min(int(total * cfg.gpu_memory_utilization) - ours, free) - reserve
        else:
            budget = _CPU_KV_DEFAULT_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes, "
                             f"{per_block} bytes per block): raise gpu_memory_utilization or "
                             "kv_cache_memory_bytes, or use a smaller model")
        return int(num_blocks)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        self.runner.capture_cuda_graphs(max_num_seqs, max_model_len)
        self._graph_args = (max_num_seqs, max_model_len)

    # -- sleep / wake --------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Give the device memory back: the KV cache and CUDA graphs always; the weights
        move to host memory (level 1) or are dropped (level 2: the next update must send
        them all)."""
        self._kv_blocks = self.runner.num_blocks
        self._ipc_plan = None  # its targets are the storage being given back
        self.runner.free_kv_cache()
        self._host_weights = {}
        for name, p in self.model.named_parameters():  # tied weights appear once
            if level == 1:
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.device.type == "cuda")
                host.copy_(p.data)
                self._host_weights[name] = host
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        self._ipc_plan = None
        for name, p in self.model.named_parameters():
            host = self._host_weights.get(name)
            if host is not None:
                p.data = host.to(self.device, non_blocking=True)
            else:  # level 2: storage comes back uninitialised until the next update
                p.data = torch.empty(self._param_shapes[name], dtype=p.dtype, device=self.device)
        self._host_weights = {}
        self.runner.allocate_kv_cache(self._kv_blocks)
        if getattr(self, "_graph_args", None) is not None:
            self.runner.capture_cuda_graphs(*self._graph_args)

    # -- execution ---------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput, block_tables: np.ndarray | list[list[int]]
                      ) -> ModelRunnerOutput:
        """block_tables: the KV manager's int32 array (one rank) or lists (a step message)."""
        return self.runner.execute(sched, block_tables)

    # -- weights -----------------------------------------------------------------------
    def load_weights(self, weights) -> set[str]:
        return self.model.load_weights(weights)

    def init_weight_transfer(self, backend: str, init_info: dict, timeout_s: float) -> None:
        """Join the trainer's group at rank rank_offset + this worker's rank (ipc: nothing
        to join; the trainer's handles arrive with each update).

        Returns within about timeout_s whatever the master does. A newer init (or
        `abort_weight_transfer`, from any thread) stops a pending one at once, and closes
        the current group, failing a receive that waits on it.
        """
        from rlserve.weight_transfer import receiver_init
        from rlserve.weight_transfer.ipc import IPCReceiver
        self.abort_weight_transfer("replaced by a newer /init_weight_transfer_engine")
        self.close_weight_transfer()
        if backend == "ipc":
            self.ipc_receiver = IPCReceiver(self.device)
            return
        group = receiver_init(backend, init_info, worker_rank=self.rank, device=self.device,
                              timeout_s=timeout_s, connect=False)
        self._connecting = group
        try:
            group.connect()
        finally:
            if self._connecting is group:
                self._connecting = None
        if group.broken is not None:  # aborted just as it connected
            group.close()
            group.check_usable()
        self.transfer_group = group
        # Read by the test suite, which checks that every group it forms stays on loopback.
        logger.info("joined the trainer's %s weight-transfer group at %s as rank %d of %d",
                    backend, group.master, group.rank, group.world_size)

    def abort_weight_transfer(self, reason: str = "aborted") -> None:
        """Thread-safe: stop a pending init, and fail a receive in progress (the group is
        then unusable until the next init)."""
        for group in (self._connecting, self.transfer_group):
            if group is not None and group.broken is None:
                group.abort(reason)

    def close_weight_transfer(self) -> None:
        group, self.transfer_group = self.transfer_group, None
        self.ipc_receiver = None
        self.lora_ipc_receivers = {}
        self._lora_plans = {}  # they hold views of the trainer's memory
        self._ipc_plan = None
        if group is not None:
            group.close()

    def _usable_group(self):
        from rlserve.weight_transfer import InvalidUpdateError
        group = self.transfer_group
        if group is None or group.broken:
            why = (f"is unusable ({group.broken})" if group is not None else "is not initialized")
            raise InvalidUpdateError(f"the weight-transfer group {why}: call "
                                     "/init_weight_transfer_engine first")
        return group

    @contextlib.contextmanager
    def _exclusive(self):
        """One receive (or refusal) at a time: a second is refused, never interleaved."""
        from rlserve.weight_transfer import InvalidUpdateError
        if not self._transfer_lock.acquire(blocking=False):
            raise InvalidUpdateError("another weight update is in progress on this worker: "
                                     "send /update_weights one at a time")
        try:
            yield
        finally:
            self._transfer_lock.release()

    def receive_weights(self, update_info: dict, lora_config: dict | None = None) -> int:
        """Receive a whole update into staging tensors; the model is untouched until
        `apply_staged_weights`. Returns the number of bytes received.

        ipc: the staging tensors are views into the trainer's memory, opened (once) and
        checked here; the one copy happens in `apply_staged_weights`.
        `lora_config` (LoRAConfig.to_wire): the update is an adapter's PEFT tensors
        (update_info.lora_name), checked against this config's ranks.
        """
        from rlserve.weight_transfer import ExpectedParam, IPCReceiver, receive_weights
        with self._exclusive():
            self.staged = self.staged_lora = None
            validate = None
            if lora_config is not None:
                config, expected, validate = self._lora_expected(lora_config)
            else:
                if self._update_expected is None:  # one object: the IPC receiver skips re-checks against it
                    self._update_expected = {name: ExpectedParam(e.shape, e.required, covers=e.covers)
                                             for name, e in self.expected.items()}
                expected = self._update_expected
            if self.ipc_receiver is not None:
                receiver = self.ipc_receiver
                if lora_config is not None:  # each adapter keeps its own handles open
                    receiver = self.lora_ipc_receivers.setdefault(update_info.get("lora_name"),
                                                                  IPCReceiver(self.device))
                self.staged = receiver.receive(update_info, expected, validate)
            else:
                group = self._usable_group()
                self.staged = receive_weights(group, update_info, expected, device=self.device,
                                              target_dtype=self.dtype, validate=validate)
            if lora_config is not None:
                self.staged_lora = config
            return sum(t.numel() * t.element_size() for _, t in self.staged)

    def _lora_expected(self, wire: dict):
        """An adapter update's config, the PEFT names and full shapes it may carry (staged
        in float32: the scaling is applied on the copy), and the check that its tensors
        come in A/B pairs, made before any byte moves."""
        from rlserve.weight_transfer import ExpectedParam, InvalidUpdateError
        if self.lora is None:
            raise InvalidUpdateError("update_info.lora_name: this server was started without --enable-lora")
        memo = self._lora_expected_memo  # a trainer pushing one adapter sends one config
        if memo is not None and memo[0] == wire:
            return memo[1]
        config = LoRAConfig.parse(wire, "update_info.lora_config", self.lora.max_rank)
        expected = {}
        for module in self.lora.targets:
            a, b = self.lora.module_shapes(module, config.rank(module))
            expected[peft_name(module, "A")] = ExpectedParam(a, False, torch.float32)
            expected[peft_name(module, "B")] = ExpectedParam(b, False, torch.float32)

        def validate(metas) -> None:
            try:
                pair_tensors(((m.name, torch.empty(m.shape, device="meta")) for m in metas), config,
                             "update_info", self.lora.exempt)
            except ValueError as e:
                raise InvalidUpdateError(str(e)) from None

        self._lora_expected_memo = (wire, (config, expected, validate))
        return config, expected, validate

    def refuse_update(self, update_info: dict, message: str) -> None:
        """The engine refused this update before receiving it (asleep, a bad weight_version,
        ...): tell a trainer that is sending it, so its trainer_send_weights raises `message`
        at once, and keep the group in step for the next push. Waits at most a couple of
        seconds for the trainer; never raises (the caller answers the refusal itself)."""
        from rlserve.weight_transfer import WeightTransferError, refuse
        group = self.transfer_group
        if self.ipc_receiver is not None or group is None or group.broken:
            return  # no group to tell: the trainer's own call fails on its own
        try:
            with self._exclusive():
                refuse(group, message)
        except (WeightTransferError, ValueError) as e:
            logger.warning("could not pass the refusal of an update to the trainer: %s", e)

    def apply_staged_weights(self, lora_slot: int | None = None) -> None:
        """Copy the staged update into the model; an adapter update goes to `lora_slot`."""
        staged, self.staged = getattr(self, "staged", None), None
        lora, self.staged_lora = self.staged_lora, None
        if staged is None:
            raise RuntimeError("no staged weights to apply")
        if lora is not None:
            if lora_slot is None:
                raise RuntimeError("a staged LoRA update needs its slot")
            # A trainer's IPC views are the same list push after push: its plan is kept.
            # Staging buffers (gloo, NCCL) are new each time, and not kept alive by a plan.
            cached = self._lora_plans.get(lora_slot)
            if cached is None or cached[0] is not staged or cached[1] != lora:
                cached = (staged, lora, self.lora.plan(lora_slot, pair_tensors(staged, lora, "update_info"),
                                                       lora.scaling))
                if self.ipc_receiver is not None:
                    self._lora_plans[lora_slot] = cached
            self.lora.run(cached[2])
            if self.device.type == "cuda":  # done reading staging (or the trainer's memory)
                torch.cuda.current_stream(self.device).synchronize()
            return
        if self.ipc_receiver is None:
            self.model.load_weights(staged)
            if self.device.type == "cuda":
                # The staging memory came from the transfer's own streams: the copies out
                # of it finish before it can be handed out again.
                torch.cuda.current_stream(self.device).synchronize()
            return
        # ipc: the receiver hands back the same views while the trainer's storage stays put,
        # so the (target, source) pairs are worked out once; sleep and wake reset them.
        plan = self._ipc_plan
        if plan is None or plan[0] is not staged:
            plan = self._ipc_plan = (staged, [(t, s) for _, t, s in self.model.weight_copies(staged)])
        with torch.no_grad():
            for target, source in plan[1]:
                target.copy_(source)
        # The copies read the trainer's memory: done before the trainer hears back.
        torch.cuda.current_stream(self.device).synchronize()

    def drop_staged_weights(self) -> None:
        self.staged = self.staged_lora = None

    # -- a new data-parallel replica takes a healthy one's weights (weight_transfer/peer.py)
    def weights_layout(self) -> str:
        from rlserve.weight_transfer.peer import layout_digest
        return layout_digest(self.model)

    def copy_weights_to_peer(self, address: str, ports: list[int], digest: str | None, timeout_s: float) -> int:
        from rlserve.weight_transfer.peer import copy_parameters
        return copy_parameters(self.model, send=True, address=address, port=ports[self.rank],
                               device=self.device, digest=digest, timeout_s=timeout_s)

    def copy_weights_from_peer(self, address: str, ports: list[int], digest: str | None, timeout_s: float) -> int:
        from rlserve.weight_transfer.peer import copy_parameters
        return copy_parameters(self.model, send=False, address=address, port=ports[self.rank],
                               device=self.device, digest=digest, timeout_s=timeout_s)

    # -- LoRA adapters -------------------------------------------------------------------
    def load_lora(self, tensors: list, slot: int, config: dict) -> None:
        """Put an adapter's full PEFT tensors (this rank keeps its shards) in `slot`."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this server (--enable-lora)")
        cfg = LoRAConfig.parse(config, "adapter_config", self.lora.max_rank)
        self.lora.load(slot, pair_tensors(tensors, cfg, "adapter"), cfg.scaling)

    def remove_lora(self, slot: int, name: str | None = None) -> None:
        self.lora.clear(slot)
        self._lora_plans.pop(slot, None)
        if name is not None:
            self.lora_ipc_receivers.pop(name, None)
