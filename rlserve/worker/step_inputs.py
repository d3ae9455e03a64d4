"""A scheduled batch as the model's inputs: token layout, attention metadata, the rows that
need logits, and one upload for all of it.

This runs for every request every step, so the per-request Python is one short loop
(`_gather_rows`); the rest is numpy over the whole batch. The host half lays the tokens out
(prefill chunks and decodes alike), finds the tokens still being sampled by the step in
flight (overlapped scheduling: filled in on the device, without waiting for it) and the
rows that need logits (logits_rows.py); `StepArrays` and the sampling rows' SamplingArrays
(rlserve/worker/sampling_inputs.py) then travel in one page-locked copy
(rlserve/worker/upload.py), and the device half assembles a BatchInputs from them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Generic, NamedTuple

import numpy as np
import torch

from rlserve.model.layers import AttentionMetadata
from rlserve.ops.lora import LoRABatch, group_tokens
from rlserve.sequence import PLACEHOLDER, ScheduledRequest, SchedulerOutput, Sequence
from rlserve.worker import sampler as S
from rlserve.worker.cuda_graphs import CudaGraphs
from rlserve.worker.logits_rows import LogitsPlan, logits_plan
from rlserve.worker.sampling_inputs import SamplingInputs
from rlserve.worker.upload import ArrayT, upload_groups


class LoRAArrays(NamedTuple, Generic[ArrayT]):
    """A step's token rows grouped by adapter slot (int32, see LoRABatch)."""

    tokens: ArrayT  # token rows, grouped by slot
    starts: ArrayT  # each slot's first token


class StepArrays(NamedTuple, Generic[ArrayT]):
    """A step's batch: host arrays in its one upload, then device tensors under the same
    names. The int32 metadata goes in the dtype its consumers take: nothing is converted
    on the device."""

    ids: ArrayT  # int64 input token per position; PLACEHOLDER where the in-flight step samples it
    positions: ArrayT  # int64
    slots: ArrayT  # int64 KV-cache slot per token
    logits_indices: ArrayT  # int64 rows of the hidden states that need logits, padded
    fill_at: ArrayT  # int64 positions whose token comes from the in-flight step
    fill_from: ArrayT  # int64 the in-flight step's row for each
    qsl: ArrayT  # int32 query start locations, [num_seqs + 1]
    seq_lens: ArrayT  # int32 tokens per sequence once this step is computed
    tables: ArrayT  # int32 block tables, [num_seqs, most blocks]
    seq_order: ArrayT  # int32 the sequences longest first (triton_attention.paged_attention)
    sample_index: ArrayT | None  # int64 logits rows that sample; None: all of them
    lora: LoRAArrays[ArrayT] | None  # runner with LoRA only


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
    """A launched step (ModelRunner.launch): its results still on the device until
    collected. The next step's inputs take the tokens it samples from here."""

    sample_requests: list  # ScheduledRequest, aligned with the rows of `sampled`
    sampled: S.SamplerOutput | None
    prompt: dict[str, tuple[list[int], int, S.LogprobStats]]  # req id -> (targets, k, device stats)
    prompt_start: dict[str, int]  # req id -> position the step's chunk started at
    requests: list = field(default_factory=list)  # the Request of each sample_requests item
    # launch(sample=False): the sampling rows' logits and parameters, until `sample`
    pending: tuple[torch.Tensor, S.SamplingBatch] | None = None
    # The results on their way to page-locked host memory (`sampled` and `prompt` with host
    # tensors), and the event that marks their arrival; None where they are on the host.
    copied: tuple[S.SamplerOutput | None, dict, torch.cuda.Event] | None = None
    # Routing capture: the step's routes on their way to the host ([tokens, layers, k]
    # int32; row i is the step's input token i) and the event marking their arrival
    routes: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def row_of(self) -> dict[str, int]:
        return {item.request.request_id: i for i, item in enumerate(self.sample_requests)}


class _Layout(NamedTuple):
    """A step's tokens on the host (see StepInputs._layout)."""

    ids: np.ndarray  # int64 input token per position; PLACEHOLDER where the in-flight step samples it
    positions: np.ndarray  # int64
    slots: np.ndarray  # int64 KV-cache slot per token
    qsl: np.ndarray  # int64 query start locations, [num_seqs + 1]
    counts: np.ndarray  # int64 tokens per sequence
    seq_lens: np.ndarray  # int64 tokens per sequence once this step is computed
    token_rows: np.ndarray  # the sequence of each token
    tables: np.ndarray  # int32 block tables, [num_seqs, most blocks]


class _InFlightFill(NamedTuple):
    """Input tokens the in-flight step is still sampling (see StepInputs._in_flight)."""

    at: np.ndarray  # int64 positions to fill
    source: np.ndarray  # int64 the in-flight step's row for each
    all: bool  # every position, from the in-flight step's rows in order (then `at` is empty)
    tokens: torch.Tensor | None  # the in-flight step's sampled tokens, on the device; None: nothing to fill


class StepInputs:
    """Builds each step's BatchInputs from the scheduler's batch."""

    def __init__(self, block_size: int, device: torch.device, max_loras: int | None, sampling: SamplingInputs):
        self.block_size = block_size
        self.device = device
        self.max_loras = max_loras  # None: the model has no LoRA slots
        self.sampling = sampling

    def prepare(
        self,
        sched: SchedulerOutput,
        block_tables: np.ndarray | list[list[int]],
        prev: StepHandle | None,
        graphs: CudaGraphs | None,
        fused: bool,
    ) -> BatchInputs:
        """Flatten the scheduled chunks into one batch. Tokens still being sampled by the
        in-flight step `prev` are filled in on the device, without waiting for it.
        `block_tables`: one row per scheduled request, as the engine's 0-padded int32
        array or as lists (another rank's step message). `graphs`: the decode graphs,
        whose sizes the LM head's rows are padded to. `fused`: the sampler takes noise keys."""
        items = sched.scheduled
        reqs, input_ids, starts, counts, totals, any_prompt_logprobs = _gather_rows(items)
        lay = self._layout(input_ids, starts, counts, block_tables)
        fill = self._in_flight(lay, reqs, prev)
        plan = logits_plan(items, reqs, lay.qsl, lay.seq_lens, lay.ids.size, totals, any_prompt_logprobs, graphs)
        step = self.sampling.host_step(plan.requests, fused) if plan.requests else None
        arrays, lora_segments = self._arrays(lay, fill, plan, reqs)
        t, sampling = upload_groups((arrays, step.arrays if step is not None else None), self.device)
        batch = self._device_batch(lay, fill, plan, t, lora_segments)
        if step is not None:
            batch.sampling = self.sampling.device_batch(
                step, sampling, self._newest_tokens(batch) if sampling.processes else None
            )
        return batch

    def _layout(
        self, input_ids: list[int], starts: list[int], counts: list[int], block_tables: np.ndarray | list[list[int]]
    ) -> _Layout:
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
        tables = table_array(block_tables)
        slots = tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        return _Layout(
            np.fromiter(input_ids, dtype=np.int64, count=num_tokens),
            positions,
            slots,
            qsl,
            count_a,
            seq_lens,
            token_rows,
            tables,
        )

    @staticmethod
    def _in_flight(lay: _Layout, reqs: list, prev: StepHandle | None) -> _InFlightFill:
        """Which input tokens the in-flight step `prev` is still sampling (PLACEHOLDERs),
        and which of its rows each comes from."""
        num_seqs = len(reqs)
        fill_at = np.flatnonzero(lay.ids == PLACEHOLDER)  # positions whose token comes from prev
        fill_from = np.empty(0, dtype=np.int64)
        if not fill_at.size:
            return _InFlightFill(fill_at, fill_from, False, None)
        assert prev is not None and prev.sampled is not None, "only the step in flight leaves PLACEHOLDERs"
        # The common case: every row is a decode of the requests prev sampled, in its order.
        fill_all = fill_at.size == lay.ids.size == num_seqs and reqs == prev.requests
        if fill_all:
            fill_at = fill_from
        else:
            prev_rows = prev.row_of()
            fill_from = np.array(
                [prev_rows[reqs[r].request_id] for r in lay.token_rows[fill_at].tolist()], dtype=np.int64
            )
        return _InFlightFill(fill_at, fill_from, fill_all, prev.sampled.token_ids)

    def _arrays(
        self, lay: _Layout, fill: _InFlightFill, plan: LogitsPlan, reqs: list
    ) -> tuple[StepArrays[np.ndarray], tuple[tuple[int, int, int], ...] | None]:
        """The step's arrays for the upload, and the LoRA segments (None without LoRA)."""
        # Attention starts the longest sequences first (see triton_attention.paged_attention).
        seq_order = np.argsort(-lay.seq_lens, kind="stable").astype(np.int32)
        lora = segments = None
        if self.max_loras is not None:
            # Each token's adapter slot (-1: the base model), tokens grouped by slot.
            num_seqs, num_tokens = len(reqs), lay.ids.size
            row_slots = np.fromiter((r.lora_slot for r in reqs), dtype=np.int32, count=num_seqs)
            lora_tokens, lora_starts, segments = group_tokens(
                row_slots if num_tokens == num_seqs else np.repeat(row_slots, lay.counts), self.max_loras
            )
            lora = LoRAArrays(lora_tokens, lora_starts)
        arrays = StepArrays(
            ids=lay.ids,
            positions=lay.positions,
            slots=lay.slots,
            logits_indices=plan.logits_indices,
            fill_at=fill.at,
            fill_from=fill.source,
            qsl=lay.qsl.astype(np.int32),
            seq_lens=lay.seq_lens.astype(np.int32),
            tables=lay.tables,
            seq_order=seq_order,
            sample_index=plan.sample_index,
            lora=lora,
        )
        return arrays, segments

    @staticmethod
    def _device_batch(
        lay: _Layout, fill: _InFlightFill, plan: LogitsPlan, t: StepArrays[torch.Tensor], lora_segments: tuple | None
    ) -> BatchInputs:
        """The device half: tokens from the in-flight step, attention metadata."""
        if fill.tokens is not None:
            if fill.all:
                t.ids.copy_(fill.tokens)
            else:
                t.ids[t.fill_at] = fill.tokens[t.fill_from]
        meta = AttentionMetadata(
            slot_mapping=t.slots,
            query_start_loc=t.qsl,
            seq_lens=t.seq_lens,
            block_tables=t.tables,
            max_query_len=int(lay.counts.max()),
            max_seq_len=int(lay.seq_lens.max()),
            seq_order=t.seq_order,
        )
        lora = LoRABatch(t.lora.tokens, t.lora.starts, lora_segments) if t.lora is not None else None
        return BatchInputs(
            input_ids=t.ids,
            positions=t.positions,
            meta=meta,
            logits_indices=t.logits_indices,
            sample_rows=plan.sample_rows,
            sample_requests=plan.sample_requests,
            requests=plan.requests,
            prompt_rows=plan.prompt_rows,
            num_logits=plan.num_logits,
            logits_identity=plan.identity,
            sample_index=t.sample_index,
            lora=lora,
        )

    @staticmethod
    def _newest_tokens(batch: BatchInputs) -> torch.Tensor:
        """Each sampling row's newest token: the input at its logits position, filled from
        the previous step's tokens on the device if still in flight."""
        rows = (
            batch.logits_indices[: batch.num_logits]
            if batch.sample_index is None
            else batch.logits_indices[batch.sample_index]
        )
        return batch.input_ids[rows]


def _gather_rows(
    items: list[ScheduledRequest],
) -> tuple[list[Sequence], list[int], list[int], list[int], list[int], bool]:
    """The one per-request loop of `prepare`: each row's request, input tokens, start,
    token count and length, and whether any row still wants prompt logprobs."""
    reqs: list[Sequence] = []
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
            input_ids.extend(tokens[start : start + n])
        starts.append(start)
        counts.append(n)
        totals.append(len(tokens))
        if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens:
            any_prompt_logprobs = True
    return reqs, input_ids, starts, counts, totals, any_prompt_logprobs


def table_array(block_tables: np.ndarray | list[list[int]]) -> np.ndarray:
    """Block tables as one int32 array [requests, most blocks], 0-padded."""
    if isinstance(block_tables, np.ndarray):
        return block_tables
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lens.sum()))
    table = np.zeros((len(block_tables), int(lens.max())), dtype=np.int32)
    table[np.arange(table.shape[1]) < lens[:, None]] = flat  # row-major, as `flat`
    return table
