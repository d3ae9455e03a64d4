"""Turns a scheduled batch into tensors, runs the model over the paged cache, samples."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from rlserve.model.base import CausalLM
from rlserve.model.layers import AttentionMetadata, PagedAttention
from rlserve.ops import kernels
from rlserve.ops.attention import FP8_DTYPES
from rlserve.ops.lora import LoRABatch, group_tokens
from rlserve.sequence import PLACEHOLDER, SchedulerOutput, TokenLogprob
from rlserve.worker import sampler as S
from rlserve.worker.penalties import PenaltyHistory, PenaltyPlan

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """A step's results on the host; row i belongs to sample_requests[i]."""

    sample_requests: list  # ScheduledRequest that sampled a token
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # request id -> logprobs of the prompt tokens this step covered, in order
    prompt_logprobs: dict[str, list[TokenLogprob]]


_ALIGN = 64  # bytes: every part of an upload starts at a multiple (see ModelRunner.upload)
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


class _Processing(NamedTuple):
    """The logits processors of a batch's rows (Request.processors), as host arrays: what
    depends only on the requests (see ModelRunner._processing)."""

    arrays: dict[str, np.ndarray]  # uploaded with every step; names as in _processing_batch
    banned_rows: np.ndarray  # int64, with banned_tokens: masked in every step
    banned_tokens: np.ndarray
    bad_word_rows: list[int]  # rows with bad words of several tokens (checked per step)
    penalty_requests: list  # the Request of each penalty row
    needs_prompt: np.ndarray  # bool per penalty row: it has a repetition penalty
    any_frequency: bool
    any_presence: bool


class _SamplingParams(NamedTuple):
    """A batch's sampling parameters that depend only on its requests (see
    ModelRunner._sampling_params), as host arrays and flags."""

    requests: list  # the Request of each row
    floats: list[np.ndarray]  # temperature, top_p, min_p (float32)
    top_k: np.ndarray  # int64, 0 = off
    seeded_rows: list[int]
    min_tokens_rows: list[int]
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_logprobs: int
    processing: _Processing | None  # None: no row has logits processors


class _SamplingStep(NamedTuple):
    """One step's sampling arrays on the host, in upload order: temperature, top_p, min_p,
    top_k, the noise keys (fused sampling), then the logits processors' arrays by name."""

    params: _SamplingParams
    seeds: list[tuple[int, int]]
    plan: PenaltyPlan | None
    arrays: list[np.ndarray]
    named: list[str]  # names of the last len(named) arrays


class _Layout(NamedTuple):
    """A step's tokens on the host (see ModelRunner._layout)."""

    ids: np.ndarray  # int64 input token per position; PLACEHOLDER where the in-flight step samples it
    positions: np.ndarray  # int64
    slots: np.ndarray  # int64 KV-cache slot per token
    qsl: np.ndarray  # int64 query start locations, [num_seqs + 1]
    counts: np.ndarray  # int64 tokens per sequence
    seq_lens: np.ndarray  # int64 tokens per sequence once this step is computed
    token_rows: np.ndarray  # the sequence of each token
    tables: np.ndarray  # int32 block tables, [num_seqs, most blocks]


class _InFlightFill(NamedTuple):
    """Input tokens the in-flight step is still sampling (see ModelRunner._in_flight)."""

    at: np.ndarray  # int64 positions to fill
    source: np.ndarray  # int64 the in-flight step's row for each
    all: bool  # every position, from the in-flight step's rows in order (then `at` is empty)


class _LogitsPlan(NamedTuple):
    """The rows that need logits, and those that sample (see ModelRunner._logits_plan)."""

    logits_indices: np.ndarray  # int64 rows of the hidden states, padded (see _lm_head_rows)
    num_logits: int  # the rows that need logits: the first num_logits of logits_indices
    identity: bool  # the rows needing logits are the hidden states' first num_logits
    sample_rows: list[int]  # index into logits_indices of each sampling request
    sample_requests: list  # ScheduledRequest that sample, aligned with sample_rows
    requests: list  # the Sequence of each sample_requests item
    prompt_rows: dict[str, tuple[int, list[int]]]  # req id -> (first logits row, target ids)
    sample_index: np.ndarray | None  # sample_rows, when not every logits row samples


class _StepTensors(NamedTuple):
    """The uploaded batch (see ModelRunner._upload), in upload order."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits_indices: torch.Tensor
    fill_at: torch.Tensor
    fill_from: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    tables: torch.Tensor
    seq_order: torch.Tensor
    sample_index: torch.Tensor | None  # uploaded only when not every logits row samples

    num_fixed = 10  # the parts every step uploads (all but sample_index)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that need logits, padded
    sample_rows: list[int]  # index into logits_indices of each sampling request
    sample_requests: list  # ScheduledRequest that sample, aligned with sample_rows
    requests: list  # the Request of each sample_requests item
    prompt_rows: dict[str, tuple[int, list[int]]]  # req id -> (first logits row, target ids)
    num_logits: int = 0  # logits_indices[:num_logits] are the rows that need logits
    logits_identity: bool = False  # those rows are hidden[:num_logits]
    sample_index: torch.Tensor | None = None  # sample_rows on the device, when not every row samples
    sampling: S.SamplingBatch | None = None  # parameters of the sampling rows
    lora: LoRABatch | None = None  # which tokens use which adapter (runner with LoRA only)


@dataclass
class StepHandle:
    """A launched step: its results still on the device until `collect`."""

    sample_requests: list  # ScheduledRequest, aligned with the rows of `sampled`
    sampled: S.SamplerOutput | None
    prompt: dict[str, tuple[list[int], int, tuple]]  # req id -> (targets, k, device stats)
    prompt_start: dict[str, int]  # req id -> position the step's chunk started at
    requests: list = field(default_factory=list)  # the Request of each sample_requests item
    # launch(sample=False): the sampling rows' logits and parameters, until `sample`
    pending: tuple[torch.Tensor, S.SamplingBatch] | None = None
    # The results on their way to page-locked host memory (`sampled` and `prompt` with host
    # tensors), and the event that marks their arrival; None where they are on the host.
    copied: tuple[S.SamplerOutput | None, dict] | None = None
    ready: torch.cuda.Event | None = None

    def row_of(self) -> dict[str, int]:
        return {item.request.request_id: i for i, item in enumerate(self.sample_requests)}


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype, block_size: int,
                 logprobs_mode: str = "raw_logprobs", lora=None,
                 kv_cache_dtype: torch.dtype | None = None):
        self.model = model
        self.lora = lora  # rlserve.model.lora.LoRAModel, when adapters are enabled
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.kernels = kernels.select(device)  # once, for the model's every layer
        kernels.bind(model, self.kernels)
        if lora is not None:
            lora.context.kernels = self.kernels
        self.attn_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # fp8 caches only
        self.num_blocks = 0
        self.graphs: CudaGraphs | None = None
        self._noise_rng = np.random.default_rng()  # keys of unseeded rows (fused sampling)
        self._sampling_cache: _SamplingParams | None = None  # see _sampling_params
        self.processed_logprobs = logprobs_mode == "processed_logprobs"
        self.penalties = PenaltyHistory(model.config.vocab_size, device)

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
        self.kv_cache = torch.empty((*shape, a.head_dim), dtype=self.kv_cache_dtype,
                                    device=self.device)
        self.kv_scales = (torch.ones(shape, dtype=torch.float32, device=self.device)
                          if self.kv_scaled else None)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            if self.kv_scales is not None:
                layer.k_scale, layer.v_scale = self.kv_scales[i, 0], self.kv_scales[i, 1]
        self.num_blocks = num_blocks

    def free_kv_cache(self) -> None:
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = layer.k_scale = layer.v_scale = None
        self.kv_cache = self.kv_scales = None
        self.graphs = None  # they captured the cache's addresses
        self.penalties.reset()  # device memory too

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode steps for a ladder of batch sizes; see CudaGraphs."""
        if self.device.type != "cuda" or not self.kernels.graphs:
            return  # the torch reference ops read tensors on the host: not capturable
        self.graphs = CudaGraphs(self, min(max_num_seqs, 512), max_model_len)

    # -- inputs ------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, block_tables: np.ndarray | list[list[int]],
                prev: StepHandle | None = None) -> BatchInputs:
        """Flatten the scheduled chunks into one batch. Tokens still being sampled by the
        in-flight step `prev` are filled in on the device, without waiting for it.
        `block_tables`: one row per scheduled request, as the engine's 0-padded int32
        array or as lists (another rank's step message).

        This runs for every request every step, so the per-request Python is one short
        loop (`_gather_rows`); the rest is numpy over the whole batch and one upload:
        the token layout (`_layout`: prefill chunks and decodes alike), the tokens to take
        from `prev` (`_in_flight`), the rows that need logits and sample (`_logits_plan`),
        then `_upload` and the device side (`_device_batch`).
        """
        items = sched.scheduled
        reqs, input_ids, starts, counts, totals, any_prompt_logprobs = self._gather_rows(items)
        lay = self._layout(input_ids, starts, counts, block_tables)
        fill = self._in_flight(lay, reqs, prev)
        plan = self._logits_plan(items, reqs, lay, totals, any_prompt_logprobs)
        step = self._sampling_host(plan.requests) if plan.requests else None
        tensors, lora, sampling_tensors = self._upload(lay, fill, plan, reqs, step)
        return self._device_batch(lay, fill, plan, step, tensors, lora, sampling_tensors, prev)

    def _layout(self, input_ids: list[int], starts: list[int], counts: list[int],
                block_tables: np.ndarray | list[list[int]]) -> _Layout:
        """Each token's id, position and KV slot, and each sequence's query span and length."""
        bs = self.block_size
        num_seqs, num_tokens = len(starts), len(input_ids)
        start_a = np.fromiter(starts, dtype=np.int64, count=num_seqs)
        if num_tokens == num_seqs:  # one token per sequence (each has at least one): decodes
            count_a = np.ones(num_seqs, dtype=np.int64)
            qsl = np.arange(num_seqs + 1, dtype=np.int64)
            token_rows = np.arange(num_seqs)
            positions = start_a
        else:
            count_a = np.array(counts, dtype=np.int64)
            qsl = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(count_a, out=qsl[1:])
            token_rows = np.repeat(np.arange(num_seqs), count_a)
            positions = np.arange(num_tokens) + np.repeat(start_a - qsl[:-1], count_a)
        seq_lens = start_a + count_a
        tables = self._table_array(block_tables)
        slots = tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        return _Layout(np.fromiter(input_ids, dtype=np.int64, count=num_tokens), positions, slots, qsl, count_a,
                       seq_lens, token_rows, tables)

    @staticmethod
    def _in_flight(lay: _Layout, reqs: list, prev: StepHandle | None) -> _InFlightFill:
        """Which input tokens the in-flight step `prev` is still sampling (PLACEHOLDERs),
        and which of its rows each comes from."""
        num_seqs = len(reqs)
        fill_at = np.flatnonzero(lay.ids == PLACEHOLDER)  # positions whose token comes from prev
        fill_from = np.empty(0, dtype=np.int64)
        # The common case: every row is a decode of the requests prev sampled, in its order.
        fill_all = fill_at.size == lay.ids.size == num_seqs and reqs == prev.requests
        if fill_all:
            fill_at = fill_from
        elif fill_at.size:
            prev_rows = prev.row_of()
            fill_from = np.array([prev_rows[reqs[r].request_id] for r in lay.token_rows[fill_at].tolist()],
                                 dtype=np.int64)
        return _InFlightFill(fill_at, fill_from, fill_all)

    def _logits_plan(self, items, reqs: list, lay: _Layout, totals: list[int],
                     any_prompt_logprobs: bool) -> _LogitsPlan:
        """The rows of the hidden states that need logits, and which of them sample."""
        num_seqs = len(reqs)
        # The chunk reaches the end of the sequence's tokens.
        samples = lay.seq_lens == np.fromiter(totals, dtype=np.int64, count=num_seqs)
        sample_index = None  # rows of the logits that sample, when not all of them do
        if any_prompt_logprobs:
            logits_indices, sample_rows, sample_requests, prompt_rows = self._logits_rows(
                items, lay.qsl.tolist(), samples.tolist())
            sample_reqs = [item.request for item in sample_requests]
            if len(sample_rows) != len(logits_indices):
                sample_index = np.array(sample_rows, dtype=np.int64)
        else:  # only the sampling rows need logits: each chunk's last token
            logits_indices = lay.qsl[1:][samples] - 1
            if len(logits_indices) == num_seqs:
                sample_requests, sample_reqs = items, reqs
            else:
                rows = np.flatnonzero(samples).tolist()
                sample_requests, sample_reqs = [items[i] for i in rows], [reqs[i] for i in rows]
            sample_rows = list(range(len(sample_requests)))
            prompt_rows = {}
        indices = np.asarray(logits_indices, dtype=np.int64)
        n = indices.size
        identity = n == lay.ids.size and bool((indices == np.arange(n)).all())
        padded = self._lm_head_rows(n)
        if padded > n:  # repeats of a real row: computed, then dropped
            indices = np.concatenate([indices, np.full(padded - n, indices[-1], dtype=np.int64)])
        return _LogitsPlan(indices, n, identity, sample_rows, sample_requests, sample_reqs,
                           prompt_rows, sample_index)

    def _lm_head_rows(self, n: int) -> int:
        """How many rows the LM head computes when n need logits: with CUDA graphs, n rounded
        up to a graph's batch size (or to a multiple of 256 above the largest). cuBLAS
        spends host time choosing a kernel the first time it meets a shape (0.4-9 ms on an
        H200), which the eager prefill steps and the short steps at the end of a run
        cannot hide; a few shapes, met at capture, pay it once."""
        graphs = self.graphs
        if graphs is None or n == 0:
            return n
        if n <= graphs.max_batch:
            return graphs.size_for(n)
        return -(-n // 256) * 256

    def _upload(self, lay: _Layout, fill: _InFlightFill, plan: _LogitsPlan, reqs: list,
                step: _SamplingStep | None):
        """One upload for the step; the int32 metadata and the sampling parameters go in
        the dtypes their consumers take, so nothing is converted on the device. Returns
        the batch's tensors, the LoRA grouping (or None) and the sampling arrays' tensors."""
        # Attention starts the longest sequences first (see triton_attention.paged_attention).
        seq_order = np.argsort(-lay.seq_lens, kind="stable").astype(np.int32)
        parts = [lay.ids, lay.positions, lay.slots, plan.logits_indices, fill.at, fill.source,
                 lay.qsl.astype(np.int32), lay.seq_lens.astype(np.int32), lay.tables, seq_order]
        if plan.sample_index is not None:
            parts.append(plan.sample_index)
        segments = None
        if self.lora is not None:
            # Each token's adapter slot (-1: the base model), tokens grouped by slot.
            num_seqs, num_tokens = len(reqs), lay.ids.size
            row_slots = np.fromiter((r.lora_slot for r in reqs), dtype=np.int32, count=num_seqs)
            order, starts, segments = group_tokens(
                row_slots if num_tokens == num_seqs else np.repeat(row_slots, lay.counts), self.lora.max_loras)
            parts += [order, starts]
        if step is not None:
            parts += step.arrays
        dev = self.upload(parts)
        n = _StepTensors.num_fixed
        tensors = _StepTensors(*dev[:n], dev[n] if plan.sample_index is not None else None)
        rest = dev[n + (plan.sample_index is not None):]
        lora = LoRABatch(rest.pop(0), rest.pop(0), segments) if segments is not None else None
        return tensors, lora, rest

    def _device_batch(self, lay: _Layout, fill: _InFlightFill, plan: _LogitsPlan, step: _SamplingStep | None,
                      t: _StepTensors, lora: LoRABatch | None, sampling_tensors: list[torch.Tensor],
                      prev: StepHandle | None) -> BatchInputs:
        """The device half: tokens from the in-flight step, attention metadata, sampling."""
        if fill.all:
            t.ids.copy_(prev.sampled.token_ids)
        elif fill.at.size:
            t.ids[t.fill_at] = prev.sampled.token_ids[t.fill_from]
        meta = AttentionMetadata(
            slot_mapping=t.slots, query_start_loc=t.qsl, seq_lens=t.seq_lens, block_tables=t.tables,
            max_query_len=int(lay.counts.max()), max_seq_len=int(lay.seq_lens.max()), seq_order=t.seq_order)
        sampling = None
        if step is not None:
            last_tokens = None
            if step.named:
                # Each sampling row's newest token: the input at its logits position,
                # filled from the previous step's tokens on the device if still in flight.
                rows = (t.logits_indices[:plan.num_logits] if t.sample_index is None
                        else t.logits_indices[t.sample_index])
                last_tokens = t.ids[rows]
            sampling = self._sampling_device(step, sampling_tensors, last_tokens)
        return BatchInputs(
            input_ids=t.ids, positions=t.positions, meta=meta, logits_indices=t.logits_indices,
            sample_rows=plan.sample_rows, sample_requests=plan.sample_requests, requests=plan.requests,
            prompt_rows=plan.prompt_rows, num_logits=plan.num_logits, logits_identity=plan.identity,
            sample_index=t.sample_index, sampling=sampling, lora=lora)

    @staticmethod
    def _gather_rows(items):
        """The one per-request loop of `prepare`: each row's request, input tokens, start,
        token count and length, and whether any row still wants prompt logprobs."""
        reqs = []
        input_ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        totals: list[int] = []
        any_prompt_logprobs = False
        for item in items:
            req = item.request
            reqs.append(req)
            start = req.num_computed_tokens
            n = item.num_new_tokens
            tokens = req.token_ids
            if n == 1:  # decode: the common case
                input_ids.append(tokens[start])
            else:
                input_ids.extend(tokens[start:start + n])
            starts.append(start)
            counts.append(n)
            totals.append(len(tokens))
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                any_prompt_logprobs = True
        return reqs, input_ids, starts, counts, totals, any_prompt_logprobs

    @staticmethod
    def _table_array(block_tables: np.ndarray | list[list[int]]) -> np.ndarray:
        """Block tables as one int32 array [requests, most blocks], 0-padded."""
        if isinstance(block_tables, np.ndarray):
            return block_tables
        lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
        flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32,
                           count=int(lens.sum()))
        table = np.zeros((len(block_tables), int(lens.max())), dtype=np.int32)
        table[np.arange(table.shape[1]) < lens[:, None]] = flat  # row-major, as `flat`
        return table

    @staticmethod
    def _logits_rows(items, qsl: list[int], samples: list[bool]):
        """Which rows need logits when some request wants prompt logprobs: its prompt
        positions (position p predicts token p + 1), then each sampling row."""
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        sample_requests = []
        prompt_rows: dict[str, tuple[int, list[int]]] = {}
        for row, item in enumerate(items):
            req = item.request
            start, flat = req.num_computed_tokens, qsl[row]
            end = start + item.num_new_tokens
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                # The prompt's first token has no logprob.
                last = min(end, req.num_prompt_tokens - 1)
                if last > start:
                    prompt_rows[req.request_id] = (len(logits_indices), req.token_ids[start + 1:last + 1])
                    logits_indices.extend(range(flat, flat + last - start))
            if samples[row]:
                sample_rows.append(len(logits_indices))
                sample_requests.append(item)
                logits_indices.append(qsl[row + 1] - 1)
        return logits_indices, sample_rows, sample_requests, prompt_rows

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Host arrays (int64, int32 or float32) -> device tensors of the same dtypes and
        shapes, in one copy from page-locked memory.

        A copy from pageable memory would make the host wait for the device's queue to
        drain, which is exactly what overlapped scheduling must avoid. Every part starts
        at a multiple of 64 bytes, as a fresh allocation does: Triton compiles a kernel
        variant per pointer alignment, and a step must not meet a new one.
        """
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        buf = host.numpy()
        for a, off in zip(arrays, offsets):
            buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        dev = host.to(self.device, non_blocking=True)
        out = []
        for a, off in zip(arrays, offsets):
            t = dev[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype])
            out.append(t if a.ndim == 1 else t.view(a.shape))
        return out

    def sampling_batch(self, reqs: list, last_tokens: torch.Tensor | None = None) -> S.SamplingBatch:
        """The sampler's parameters for rows `reqs` on their own (prepare builds the same
        within a step's upload); `last_tokens`: each row's newest token, on the device
        (by default the newest of its token_ids)."""
        step = self._sampling_host(reqs)
        if last_tokens is None and step.named:
            last_tokens = torch.tensor([r.token_ids[-1] for r in reqs], device=self.device)
        return self._sampling_device(step, self.upload(step.arrays), last_tokens)

    def _sampling_host(self, reqs: list) -> _SamplingStep:
        """Host half: this step's sampling arrays for the upload."""
        params = self._sampling_params(reqs)
        seeds, bans = self._seeds_and_bans(params)
        arrays = [*params.floats, params.top_k]
        if self.fused_sampling:
            arrays.append(self._noise_keys(len(reqs), seeds))
        plan = self._penalty_plan(params)
        named: dict[str, np.ndarray] = {}  # the logits processors' arrays, when any row has them
        if params.processing is not None:
            named.update(params.processing.arrays)
        if bans is not None:
            named.update(bans)
        if plan is not None:
            named.update({f"hist_{k}": v for k, v in plan.arrays.items()})
        return _SamplingStep(params, seeds, plan, arrays + list(named.values()), list(named))

    def _sampling_device(self, step: _SamplingStep, tensors: list[torch.Tensor],
                         last_tokens: torch.Tensor | None) -> S.SamplingBatch:
        """Device half: the SamplingBatch from the step's uploaded `tensors` (in the order
        of step.arrays)."""
        params = step.params
        temp_t, top_p_t, min_p_t, top_k_t = tensors[:4]
        num_plain = len(tensors) - len(step.named)
        processing = None
        if step.named:
            processing = self._processing_batch(params, step.plan, dict(zip(step.named, tensors[num_plain:])),
                                                last_tokens)
        return S.SamplingBatch(
            temperature=temp_t, top_p=top_p_t, min_p=min_p_t, top_k=top_k_t,
            seeds=step.seeds, all_greedy=params.all_greedy, any_greedy=params.any_greedy,
            need_top_k=params.need_top_k, need_top_p=params.need_top_p, need_min_p=params.need_min_p,
            max_logprobs=params.max_logprobs, noise_seeds=tensors[4] if self.fused_sampling else None,
            processing=processing, processed_logprobs=self.processed_logprobs)

    def _sampling_params(self, reqs: list) -> _SamplingParams:
        """The sampling rows' parameters. A request's never change (Request.sampling_row),
        so while the batch holds the same requests in the same order, as it does from one
        decode step to the next, the previous step's arrays are reused."""
        cached = self._sampling_cache
        if cached is not None and cached.requests == reqs:  # Request compares by identity
            return cached
        n = len(reqs)
        table = np.fromiter(itertools.chain.from_iterable(r.sampling_row for r in reqs),
                            dtype=np.float64, count=n * 8).reshape(n, 8)
        temp, top_p, min_p, top_k, seeded, min_tokens, logprobs, processors = table.T
        greedy = temp == 0
        processor_rows = np.flatnonzero(processors).tolist()
        self._sampling_cache = _SamplingParams(
            reqs, [temp.astype(np.float32), top_p.astype(np.float32), min_p.astype(np.float32)],
            top_k.astype(np.int64),
            np.flatnonzero(seeded).tolist(), np.flatnonzero(min_tokens).tolist(),
            bool(greedy.all()), bool(greedy.any()), bool((top_k > 0).any()),
            bool((top_p < 1).any()), bool((min_p > 0).any()), int(logprobs.max()),
            self._processing(reqs, processor_rows) if processor_rows else None)
        return self._sampling_cache

    @staticmethod
    def _processing(reqs: list, rows: list[int]) -> _Processing:
        """Batch the logits processors of `rows` (the rows whose request has any)."""
        def rows_of(i: int, ids: np.ndarray) -> np.ndarray:
            return np.full(ids.size, i, dtype=np.int64)

        def cat(parts: list[np.ndarray], dtype=np.int64) -> np.ndarray:
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

        allowed_rows, allowed_r, allowed_t, bias_r, bias_t, bias_v, ban_r, ban_t = ([] for _ in range(8))
        bad_word_rows, penalty_rows, penalties = [], [], []
        for i in rows:
            proc = reqs[i].processors
            if proc.allowed is not None:
                allowed_rows.append(i)
                allowed_r.append(rows_of(i, proc.allowed))
                allowed_t.append(proc.allowed)
            if proc.bias_ids.size:
                bias_r.append(rows_of(i, proc.bias_ids))
                bias_t.append(proc.bias_ids)
                bias_v.append(proc.bias_values)
            if proc.banned.size:
                ban_r.append(rows_of(i, proc.banned))
                ban_t.append(proc.banned)
            if proc.bad_prefixes:
                bad_word_rows.append(i)
            if proc.penalties is not None:
                penalty_rows.append(i)
                penalties.append(proc.penalties)
        arrays = {}
        if allowed_rows:
            arrays.update(allowed_rows=np.array(allowed_rows, dtype=np.int64),
                          allowed_r=cat(allowed_r), allowed_t=cat(allowed_t))
        if bias_r:
            arrays.update(bias_r=cat(bias_r), bias_t=cat(bias_t), bias_v=cat(bias_v, np.float32))
        pen = np.array(penalties, dtype=np.float32).reshape(-1, 3)  # repetition, frequency, presence
        if penalty_rows:
            arrays.update(pen_repetition=pen[:, 0].copy(), pen_frequency=pen[:, 1].copy(),
                          pen_presence=pen[:, 2].copy())
            if len(penalty_rows) < len(reqs):  # else every row, in order
                arrays["pen_rows"] = np.array(penalty_rows, dtype=np.int64)
        return _Processing(arrays, cat(ban_r), cat(ban_t), bad_word_rows,
                           [reqs[i] for i in penalty_rows], pen[:, 0] != 1,
                           bool((pen[:, 1] != 0).any()), bool((pen[:, 2] != 0).any()))

    @staticmethod
    def _seeds_and_bans(params: _SamplingParams) -> tuple[list[tuple[int, int]], dict[str, np.ndarray] | None]:
        """What depends on the step: each seeded row's per-token seed, and the tokens
        masked this step: stop tokens in rows still below min_tokens, and bad words. Only
        rows that have them are looked at.

        A bad word of several tokens is masked when the output ends with all but its last
        token. The newest of those may still be in flight (a placeholder): the host checks
        the older ones and the device the newest (`ban_after`)."""
        seeds = []
        for i in params.seeded_rows:
            req = params.requests[i]
            seeds.append((i, S.mix_seed(req.sampling_params.seed, req.sample_index,
                                        len(req.token_ids) - req.num_prompt_tokens)))
        rows: list[int] = []
        toks: list[int] = []
        after: list[int] = []
        for i in params.min_tokens_rows:
            req = params.requests[i]
            if len(req.token_ids) - req.num_prompt_tokens < req.sampling_params.min_tokens:
                rows.extend(i for _ in req.stop_ids)  # what could end it too early
                toks.extend(req.stop_ids)
        proc = params.processing
        for i in proc.bad_word_rows if proc is not None else ():
            req = params.requests[i]
            tokens, n = req.token_ids, len(req.token_ids)
            num_output = n - req.num_prompt_tokens
            for prefix, last in req.processors.bad_prefixes:
                k = len(prefix)
                if k <= num_output and tuple(tokens[n - k:n - 1]) == prefix[:-1]:
                    rows.append(i)
                    toks.append(last)
                    after.append(prefix[-1])
        static = proc is not None and proc.banned_rows.size
        if not rows and not static:
            return seeds, None
        bans = {"ban_rows": np.array(rows, dtype=np.int64), "ban_tokens": np.array(toks, dtype=np.int64)}
        if after:  # the unconditional ones first, then those that wait for the newest token
            unconditional = len(rows) - len(after)
            bans["ban_after"] = np.array([-1] * unconditional + after, dtype=np.int64)
        if static:
            bans["ban_rows"] = np.concatenate([proc.banned_rows, bans["ban_rows"]])
            bans["ban_tokens"] = np.concatenate([proc.banned_tokens, bans["ban_tokens"]])
            if after:
                bans["ban_after"] = np.concatenate([np.full(proc.banned_rows.size, -1, dtype=np.int64),
                                                    bans["ban_after"]])
        return seeds, bans

    def _penalty_plan(self, params: _SamplingParams):
        """The penalty rows' token history for this step (rlserve.worker.penalties)."""
        proc = params.processing
        if proc is None or not proc.penalty_requests:
            if self.penalties.requests:
                self.penalties.reset()
            return None
        return self.penalties.plan(proc.penalty_requests, proc.needs_prompt)

    def _processing_batch(self, params: _SamplingParams, plan, t: dict[str, torch.Tensor],
                          last_tokens: torch.Tensor) -> S.LogitsProcessing:
        """The step's LogitsProcessing from its uploaded arrays `t` (see _processing,
        _seeds_and_bans and _penalty_plan); `last_tokens`: each row's newest token."""
        out = S.LogitsProcessing(last_tokens=last_tokens)
        if "allowed_rows" in t:
            out.allowed_rows, out.allowed = t["allowed_rows"], (t["allowed_r"], t["allowed_t"])
        if "ban_rows" in t:
            out.bans, out.ban_after = (t["ban_rows"], t["ban_tokens"]), t.get("ban_after")
        if "bias_r" in t:
            out.bias = (t["bias_r"], t["bias_t"], t["bias_v"])
        if plan is not None:
            proc = params.processing
            rows = t.get("pen_rows")
            history = {k[5:]: v for k, v in t.items() if k.startswith("hist_")}
            counts, prompt_mask = self.penalties.build(
                plan, history, last_tokens if rows is None else last_tokens[rows])
            out.penalties = S.Penalties(
                rows=rows, repetition=t["pen_repetition"].view(-1, 1), frequency=t["pen_frequency"].view(-1, 1),
                presence=t["pen_presence"].view(-1, 1), counts=counts, prompt_mask=prompt_mask,
                any_repetition=bool(proc.needs_prompt.any()), any_frequency=proc.any_frequency,
                any_presence=proc.any_presence)
        return out

    def _noise_keys(self, num_rows: int, seeds: list[tuple[int, int]]) -> np.ndarray:
        """One Philox key per row for fused sampling: the row's per-token seed, or a fresh
        random one."""
        keys = self._noise_rng.integers(0, 1 << 62, size=num_rows, dtype=np.int64)
        for i, seed in seeds:
            keys[i] = seed
        return keys

    # -- the step ----------------------------------------------------------------------
    def forward(self, batch: BatchInputs, decode_only: bool) -> torch.Tensor:
        """The last hidden states: a row per input token, and from a CUDA graph also its
        padded rows after them."""
        n = batch.input_ids.shape[0]
        if decode_only and self.graphs is not None and n <= self.graphs.max_batch:
            return self.graphs.run(batch)
        if self.lora is None:
            return self.model(batch.input_ids, batch.positions, batch.meta)
        # Eager: the LoRA layers run only when some token of the step has an adapter.
        self.lora.context.batch = batch.lora if batch.lora.segments else None
        try:
            return self.model(batch.input_ids, batch.positions, batch.meta)
        finally:
            self.lora.context.batch = None

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, block_tables: np.ndarray | list[list[int]],
               prev: StepHandle | None = None, sample: bool = True) -> StepHandle:
        """Queue the step on the device; nothing here waits for the device.

        `sample=False` queues the forward pass and leaves the sampling to `sample`, for a
        grammar mask that the host can only fill once the previous step's tokens are back."""
        batch = self.prepare(sched, block_tables, prev)
        hidden = self.forward(batch, decode_only=batch.meta.max_query_len == 1)
        n, padded = batch.num_logits, batch.logits_indices.shape[0]
        if not n:
            return StepHandle([], None, {}, {})
        # A decode graph's rows are the padded rows the LM head wants: no gather.
        rows = hidden[:padded] if batch.logits_identity and hidden.shape[0] >= padded \
            else hidden[batch.logits_indices]
        logits = self.model.compute_logits(rows)
        if padded != n:
            logits = logits[:n]
        sampled = pending = None
        if batch.sampling is not None:
            # Every logits row samples unless some are prompt positions.
            rows_logits = logits if batch.sample_index is None else logits[batch.sample_index]
            if sample:
                sampled = S.sample(rows_logits, batch.sampling, self.kernels.sample)
            else:
                pending = (rows_logits, batch.sampling)
        prompt, prompt_start = {}, {}
        for rid, (first, targets) in batch.prompt_rows.items():
            req = next(it.request for it in sched.scheduled if it.request.request_id == rid)
            k = req.sampling_params.prompt_logprobs
            lp = S.raw_logprobs(logits[first:first + len(targets)])
            prompt[rid] = (targets, k, S.logprob_stats(lp, torch.tensor(targets, device=lp.device), k))
            prompt_start[rid] = req.num_computed_tokens
        handle = StepHandle(batch.sample_requests, sampled, prompt, prompt_start, batch.requests, pending)
        if pending is None:
            self._copy_out(handle)
        return handle

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
            out = S.SamplerOutput(*map(host, (out.token_ids, out.logprobs, out.ranks, out.top_ids,
                                              out.top_logprobs)))
        prompt = {rid: (targets, k, tuple(map(host, stats))) for rid, (targets, k, stats) in handle.prompt.items()}
        handle.copied = (out, prompt)
        handle.ready = torch.cuda.Event()
        handle.ready.record()

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
            mask = np.asarray(token_bitmask, dtype=np.int32)
            rows = np.flatnonzero((mask != -1).any(axis=1))
            if rows.size:
                rows_t, mask_t = self.upload([rows.astype(np.int64), np.ascontiguousarray(mask[rows])])
                batch = dataclasses.replace(batch, token_bitmask=mask_t,
                                            token_bitmask_rows=None if rows.size == mask.shape[0] else rows_t)
        handle.sampled = S.sample(logits, batch, self.kernels.sample)
        self._copy_out(handle)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Bring a launched step's results to the host: the one sync of a step."""
        token_ids: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        sampled, prompt = handle.sampled, handle.prompt
        if handle.ready is not None:
            handle.ready.synchronize()
            sampled, prompt = handle.copied
        if sampled is not None:
            token_ids = sampled.token_ids.tolist()
            logprobs = self._to_logprobs(sampled, token_ids, handle.sample_requests)
        prompt_lps = {rid: self._pack_logprobs(targets, *stats, [k] * len(targets))
                      for rid, (targets, k, stats) in prompt.items()}
        return ModelRunnerOutput(handle.sample_requests, token_ids, logprobs, prompt_lps)

    def execute(self, sched: SchedulerOutput, block_tables: np.ndarray | list[list[int]],
                token_bitmask: torch.Tensor | np.ndarray | None = None) -> ModelRunnerOutput:
        """One step, start to end. `token_bitmask`: as for `sample`, one row per scheduled
        request that samples (ScheduledRequest.samples), in schedule order."""
        if token_bitmask is None:
            return self.collect(self.launch(sched, block_tables))
        handle = self.launch(sched, block_tables, sample=False)
        self.sample(handle, token_bitmask)
        return self.collect(handle)

    def _to_logprobs(self, out: S.SamplerOutput, tokens: list[int], items) -> list[TokenLogprob | None]:
        if out.logprobs is None:
            return [None] * len(tokens)
        ks = [it.request.sampling_params.logprobs for it in items]
        return self._pack_logprobs(tokens, out.logprobs, out.ranks, out.top_ids, out.top_logprobs, ks)

    @staticmethod
    def _pack_logprobs(tokens, chosen, ranks, top_ids, top_lp, ks) -> list[TokenLogprob | None]:
        chosen, ranks = chosen.tolist(), ranks.tolist()
        top_ids = top_ids.tolist() if top_ids is not None else None
        top_lp = top_lp.tolist() if top_lp is not None else None
        result: list[TokenLogprob | None] = []
        for i, (tok, k) in enumerate(zip(tokens, ks)):
            if k is None:
                result.append(None)
                continue
            top = tuple(zip(top_ids[i][:k], top_lp[i][:k])) if k and top_ids is not None else ()
            result.append(TokenLogprob(tok, chosen[i], ranks[i], top))
        return result


class CudaGraphs:
    """Decode steps replayed from CUDA graphs: one graph per padded batch size.

    Inputs are copied into static buffers (one kernel, ops/triton_graph_inputs.py); padded
    rows write nowhere (slot -1) and attend to one key of block 0, so their (discarded)
    outputs cost almost nothing. Weight updates copy into the same parameter storage, so
    the graphs stay valid across them.
    """

    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int):
        self.runner = runner
        self.max_model_len = max_model_len
        self.sizes = sorted({s for s in [1, 2, 4, 8] + list(range(16, max_batch + 1, 16)) if s <= max_batch}
                            | {max_batch})
        self.max_batch = self.sizes[-1]
        dev = runner.device
        max_blocks = -(-max_model_len // runner.block_size)
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=dev)
        self.order = torch.arange(b, dtype=torch.int32, device=dev)
        # Graphs run only with the Triton kernel set (Kernels.graphs): triton imports here.
        from rlserve.ops.triton_graph_inputs import stage_graph_inputs
        self.stage = stage_graph_inputs  # a step's rows into these buffers, padding rows after
        lora = runner.lora
        if lora is not None:  # the step's token grouping by adapter (padded rows in no slot)
            self.lora_tokens = torch.zeros(b, dtype=torch.int32, device=dev)
            self.lora_starts = torch.zeros(lora.max_loras + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: smaller ones reuse its pool
                meta = self._meta(size)
                args = (self.input_ids[:size], self.positions[:size], meta)
                if lora is not None:  # the LoRA kernels are captured reading the static buffers
                    lora.context.batch = LoRABatch(self.lora_tokens[:size], self.lora_starts)
                runner.model(*args)  # compiles kernels outside the capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = runner.model(*args)
                pool = graph.pool()
                self.graphs[size] = (graph, out)
                runner.model.compute_logits(out)  # cuBLAS chooses its kernel for this shape now
            if lora is not None:
                lora.context.batch = None
            self._first_replays()
        torch.cuda.synchronize(dev)

    def _first_replays(self) -> None:
        """Replay every graph once, on the padding rows the buffers hold (they write
        nowhere): a graph's first launch takes the host ~0.4 ms, later ones ~0.01 ms
        (H200), a stall that would otherwise land in the first step of each batch size."""
        for graph, _ in self.graphs.values():
            graph.replay()

    def size_for(self, n: int) -> int:
        """The batch size of the graph that runs n sequences (n <= max_batch)."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(self.slots[:size], self.qsl[:size + 1], self.seq_lens[:size],
                                 self.tables[:size], 1, self.max_model_len, self.order[:size])

    def run(self, batch: BatchInputs) -> torch.Tensor:
        n = batch.input_ids.shape[0]
        size = self.size_for(n)
        m = batch.meta
        self.stage(batch.input_ids, batch.positions, m.slot_mapping, m.seq_lens, m.seq_order, m.block_tables,
                   self.input_ids, self.positions, self.slots, self.seq_lens, self.order, self.tables, size)
        if batch.lora is not None:
            self.lora_tokens[:n].copy_(batch.lora.sorted_tokens)
            self.lora_starts.copy_(batch.lora.slot_starts)
        graph, out = self.graphs[size]
        graph.replay()
        return out  # padded: the LM head takes the batch's graph size (_lm_head_rows)
