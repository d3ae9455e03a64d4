"""Runs a scheduled batch: prepare its inputs, launch the model over the paged cache,
sample, collect the tokens.

    prepare  the batch's tensors in one upload (step_inputs.py; sampling_inputs.py)
    launch   the forward pass (eager, or a CUDA graph: cuda_graphs.py), the LM head on
             the rows that need logits, the sampler (sampler.py) unless a grammar mask
             must wait for the previous step's tokens (`sample`)
    collect  the one wait of a step: its tokens and logprobs on the host (logprobs.py)

Every tensor-parallel rank runs these three, in this order. Rank 0 alone samples (it holds
the grammar masks and the engine reads its tokens) and broadcasts the tokens over the TP
group; the other ranks take them from there, so every rank's next step reads the same
tokens, also where that step was launched before this one's tokens reached the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from rlserve.distributed import TPGroup
from rlserve.model.base import CausalLM
from rlserve.model.gated_deltanet import (
    StateBatch,
    bind_states,
    copy_states,
    linear_attention_layers,
    pad_slot,
    state_bytes_per_sequence,
)
from rlserve.model.layers import PagedAttention
from rlserve.model.moe import SparseMoeBlock
from rlserve.model.routed_experts import RoutedExpertsCapturer
from rlserve.ops import kernels
from rlserve.ops.attention import FP8_DTYPES
from rlserve.sequence import SchedulerOutput, TokenLogprob
from rlserve.worker import sampler as S
from rlserve.worker.cuda_graphs import CudaGraphs
from rlserve.worker.logprobs import pack_logprobs, prompt_logprobs, sampled_logprobs
from rlserve.worker.sampling_inputs import SamplingInputs
from rlserve.worker.step_inputs import BatchInputs, StepHandle, StepInputs

if TYPE_CHECKING:
    from rlserve.model.lora import LoRAModel

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """A step's results on the host; row i belongs to sample_requests[i]."""

    sample_requests: list  # ScheduledRequest that sampled a token
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # request id -> logprobs of the prompt tokens this step covered, in order
    prompt_logprobs: dict[str, list[TokenLogprob]]
    # Routing capture: [tokens, num_hidden_layers, top_k] int32, a row per input token of
    # the step in schedule order (then any padding rows); None: not captured
    routes: np.ndarray | None = None


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        logprobs_mode: str = "raw_logprobs",
        lora: LoRAModel | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        batch_invariant: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        self.model = model
        self.tp = tp or TPGroup()
        self.lora = lora  # when adapters are enabled
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.kernels = kernels.select(device, batch_invariant=batch_invariant, dtype=dtype)  # once, for every layer
        moe = next((m for m in model.modules() if isinstance(m, SparseMoeBlock)), None)
        if moe is not None and device.type == "cuda":
            self.kernels = kernels.check_router(self.kernels, device, moe.gate.out_features, moe.top_k)
        kernels.bind(model, self.kernels)
        if lora is not None:
            lora.context.kernels = self.kernels
        self.attn_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.state_layers = linear_attention_layers(model)  # a hybrid model's; their state pool beside the KV
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # fp8 caches only
        self.num_blocks = 0
        self.graphs: CudaGraphs | None = None
        self.sampling = SamplingInputs(model.config.vocab_size, device, logprobs_mode == "processed_logprobs")
        self.inputs = StepInputs(block_size, device, None if lora is None else lora.max_loras, self.sampling)
        self.routes: RoutedExpertsCapturer | None = None  # enable_return_routed_experts, MoE models

    def capture_routes(self, max_tokens: int) -> None:
        """Record every token's experts at every MoE layer (before CUDA graphs are captured:
        they write into the buffer made here)."""
        self.routes = RoutedExpertsCapturer.attach(self.model, max_tokens, self.device)

    @property
    def fused_sampling(self) -> bool:
        """Rows with temperature alone take the kernel set's Gumbel-max sampler."""
        return self.kernels.sample is not None

    # -- KV cache --------------------------------------------------------------------
    @property
    def kv_scaled(self) -> bool:
        """fp8 caches keep a float32 scale per token and kv head (ops/attention.py)."""
        return self.kv_cache_dtype in FP8_DTYPES

    def kv_bytes_per_block(self) -> int:
        a = self.attn_layers[0]
        rows = 2 * self.block_size * a.num_kv_heads * len(self.attn_layers)
        return rows * (a.head_dim * self.kv_cache_dtype.itemsize + (4 if self.kv_scaled else 0))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        a = self.attn_layers[0]
        shape = (len(self.attn_layers), 2, num_blocks, self.block_size, a.num_kv_heads)
        self.kv_cache = torch.empty((*shape, a.head_dim), dtype=self.kv_cache_dtype, device=self.device)
        self.kv_scales = torch.ones(shape, dtype=torch.float32, device=self.device) if self.kv_scaled else None
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            if self.kv_scales is not None:
                layer.k_scale, layer.v_scale = self.kv_scales[i, 0], self.kv_scales[i, 1]
        self.num_blocks = num_blocks

    def state_bytes_per_sequence(self) -> int:
        """A running sequence's linear-attention states (0: not a hybrid model)."""
        return state_bytes_per_sequence(self.model, self.dtype)

    def allocate_states(self, num_slots: int) -> None:
        """A hybrid model's state pool: `num_slots` sequences (max_num_seqs, and the prefix
        cache's: EngineConfig.state_cache_slots)."""
        bind_states(self.model, num_slots, self.device, self.dtype)

    def free_kv_cache(self) -> None:
        bind_states(self.model, 0, self.device, self.dtype)
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = layer.k_scale = layer.v_scale = None
        self.kv_cache = self.kv_scales = None
        self.graphs = None  # they captured the cache's addresses
        self.sampling.penalties.reset()  # device memory too

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, largest_only: bool = False) -> None:
        """Capture decode steps for a ladder of batch sizes (or its largest alone); see CudaGraphs."""
        if self.device.type != "cuda" or not self.kernels.graphs:
            return  # the torch reference ops read tensors on the host: not capturable
        state_pad = pad_slot(self.state_layers) if self.state_layers else None
        self.graphs = CudaGraphs(
            self.model,
            self.device,
            self.block_size,
            self.lora,
            min(max_num_seqs, 512),
            max_model_len,
            largest_only,
            state_pad,
        )

    # -- inputs ------------------------------------------------------------------------
    def prepare(
        self, sched: SchedulerOutput, block_tables: np.ndarray | list[list[int]], prev: StepHandle | None = None
    ) -> BatchInputs:
        """The step's tensors in one upload (StepInputs.prepare); tokens still being
        sampled by the in-flight step `prev` are filled in on the device."""
        return self.inputs.prepare(sched, block_tables, prev, self.graphs, self.fused_sampling)

    def sampling_batch(self, reqs: list, last_tokens: torch.Tensor | None = None) -> S.SamplingBatch:
        """The sampler's parameters for rows `reqs` on their own (SamplingInputs.batch)."""
        return self.sampling.batch(reqs, self.fused_sampling, last_tokens)

    # -- the step ----------------------------------------------------------------------
    def forward(self, batch: BatchInputs, decode_only: bool) -> torch.Tensor:
        """The last hidden states: a row per input token, and from a CUDA graph also its
        padded rows after them."""
        n = batch.input_ids.shape[0]
        if decode_only and self.graphs is not None and n <= self.graphs.max_batch:
            return self.graphs.run(batch.input_ids, batch.positions, batch.meta, batch.lora)
        if self.lora is None:
            return self.model(batch.input_ids, batch.positions, batch.meta)
        # Eager: the LoRA layers run only when some token of the step has an adapter.
        self.lora.context.batch = batch.lora if batch.lora is not None and batch.lora.segments else None
        try:
            return self.model(batch.input_ids, batch.positions, batch.meta)
        finally:
            self.lora.context.batch = None

    @torch.inference_mode()
    def launch(
        self,
        sched: SchedulerOutput,
        block_tables: np.ndarray | list[list[int]],
        prev: StepHandle | None = None,
        sample: bool = True,
    ) -> StepHandle:
        """Queue the step on the device; nothing here waits for the device.

        `sample=False` queues the forward pass and leaves the sampling to `sample`, for a
        grammar mask that the host can only fill once the previous step's tokens are back."""
        batch = self.prepare(sched, block_tables, prev)
        if self.state_layers:
            batch.meta.states = self._state_batch(sched, batch)
            copy_states(self.state_layers, sched.state_loads)  # prefix-cache hits start from these
        hidden = self.forward(batch, decode_only=batch.meta.max_query_len == 1)
        if self.state_layers:
            copy_states(self.state_layers, sched.state_saves)
        routes = self._copy_routes(batch.input_ids.shape[0]) if self.routes is not None else None
        n, padded = batch.num_logits, batch.logits_indices.shape[0]
        if not n:
            return StepHandle([], None, {}, {}, routes=routes)
        if batch.prompt_rows:
            rows_logits, prompt, prompt_start = prompt_logprobs(self.model, sched, batch, hidden)
        else:
            # A decode graph's rows are the padded rows the LM head wants: no gather.
            rows = (
                hidden[:padded] if batch.logits_identity and hidden.shape[0] >= padded else hidden[batch.logits_indices]
            )
            rows_logits = self.model.compute_logits(rows)
            if padded != n:
                rows_logits = rows_logits[:n]
            prompt, prompt_start = {}, {}
        sampled = pending = None
        if batch.sampling is not None:
            if self.tp.rank > 0:
                sampled = self._tokens_from_rank0(rows_logits.shape[0])
            elif sample:
                sampled = self._share(S.sample(rows_logits, batch.sampling, self.kernels.sample))
            else:
                pending = (rows_logits, batch.sampling)
        handle = StepHandle(
            batch.sample_requests, sampled, prompt, prompt_start, batch.requests, pending, routes=routes
        )
        if pending is None:
            self._copy_out(handle)
        return handle

    def _copy_routes(self, num_tokens: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue the copy of the step's routes to the host, right behind its forward pass."""
        assert self.routes is not None
        host = self.routes.copy_out(num_tokens)
        if self.device.type != "cuda":
            return host, None
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _state_batch(self, sched: SchedulerOutput, batch: BatchInputs) -> StateBatch:
        """Each sequence's state slot, and whether its chunk starts the sequence."""
        items = sched.scheduled
        qsl = [0]
        for it in items:
            qsl.append(qsl[-1] + it.num_new_tokens)
        return StateBatch.build(
            [it.request.state_slot for it in items], qsl, [it.request.num_computed_tokens for it in items], self.device
        )

    def _copy_out(self, handle: StepHandle) -> None:
        """Queue the copy of the step's results to the host right behind the step itself.
        `collect` then waits for this step alone: a plain `.tolist()` there would queue its
        copy behind the next step, which overlapped scheduling has launched by then, and
        the device would idle while the host prepared the step after that."""
        if self.device.type != "cuda":
            return

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=True)  # page-locked

        out = handle.sampled
        if out is not None:
            out = S.SamplerOutput(
                out.token_ids.to("cpu", non_blocking=True),
                *map(host, (out.logprobs, out.ranks, out.top_ids, out.top_logprobs)),
            )
        prompt = {rid: (targets, k, tuple(map(host, stats))) for rid, (targets, k, stats) in handle.prompt.items()}
        ready = torch.cuda.Event()
        ready.record()
        handle.copied = (out, prompt, ready)

    @torch.inference_mode()
    def sample(self, handle: StepHandle, token_bitmask: torch.Tensor | np.ndarray | None = None) -> None:
        """Queue the sampling of a step launched with sample=False (before the next step's
        launch, which reads its tokens). `token_bitmask`: [rows, ceil(V / 32)] int32 on the
        host, one row per handle.sample_requests item (structured_output.fill_bitmask);
        rows with every bit set cost nothing."""
        if handle.pending is None:
            return
        logits, batch = handle.pending
        handle.pending = None
        if token_bitmask is not None:
            batch = self.sampling.with_bitmask(batch, token_bitmask)
        handle.sampled = self._share(S.sample(logits, batch, self.kernels.sample))
        self._copy_out(handle)

    def _share(self, out: S.SamplerOutput) -> S.SamplerOutput:
        """Rank 0's tokens to the other ranks (queued on the stream, no wait on the host)."""
        if self.tp.world_size > 1:
            assert out.token_ids.dtype == torch.int64  # what the other ranks receive into
            self.tp.broadcast(out.token_ids, src=0)
        return out

    def _tokens_from_rank0(self, rows: int) -> S.SamplerOutput:
        """The tokens rank 0 sampled for this step's `rows` (it broadcasts them once sampled,
        before its next launch; the wait is the device's, or gloo's on the CPU)."""
        token_ids = torch.empty(rows, dtype=torch.int64, device=self.device)
        self.tp.broadcast(token_ids, src=0)
        return S.SamplerOutput(token_ids, None, None, None, None)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Bring a launched step's results to the host: the one sync of a step."""
        token_ids: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        sampled, prompt = handle.sampled, handle.prompt
        if handle.copied is not None:
            sampled, prompt, ready = handle.copied
            ready.synchronize()
        if sampled is not None:
            token_ids = sampled.token_ids.tolist()
            logprobs = sampled_logprobs(sampled, token_ids, handle.sample_requests)
        # Every prompt row asked for logprobs (an int k): its list holds no None.
        prompt_lps = {
            rid: cast(list[TokenLogprob], pack_logprobs(targets, *stats, [k] * len(targets)))
            for rid, (targets, k, stats) in prompt.items()
        }
        routes = None
        if handle.routes is not None:
            host, routes_ready = handle.routes
            if routes_ready is not None:
                routes_ready.synchronize()
            routes = host.numpy()
        return ModelRunnerOutput(handle.sample_requests, token_ids, logprobs, prompt_lps, routes)

    def execute(
        self,
        sched: SchedulerOutput,
        block_tables: np.ndarray | list[list[int]],
        token_bitmask: torch.Tensor | np.ndarray | None = None,
    ) -> ModelRunnerOutput:
        """One step, start to end. `token_bitmask`: as for `sample`, one row per scheduled
        request that samples (ScheduledRequest.samples), in schedule order."""
        if token_bitmask is None:
            return self.collect(self.launch(sched, block_tables))
        handle = self.launch(sched, block_tables, sample=False)
        self.sample(handle, token_bitmask)
        return self.collect(handle)
