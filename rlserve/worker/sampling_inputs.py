"""A batch's sampling inputs: the sampler's per-row parameters and the logits processors'
arrays (processor_arrays.py), built on the host and carried to the device in the step's
one upload.

What depends only on a batch's requests (their SamplingRow and LogitsProcessors, fixed for
their lives) is computed once and reused while the batch holds the same requests in the
same order, as it does from one decode step to the next (`SamplingRows`). What depends on
the step (per-token seeds, bans that follow the output, the penalties' token history) is
added each step (`SamplingStep`). `SamplingArrays` is the one typed value that travels:
host arrays before the upload, device tensors of the same names after it; the device half
turns it into the sampler's SamplingBatch (rlserve/worker/sampler.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Generic, NamedTuple

import numpy as np
import torch

from rlserve.sequence import SamplingRow
from rlserve.worker import sampler as S
from rlserve.worker.penalties import HistoryArrays, PenaltyHistory, PenaltyPlan
from rlserve.worker.processor_arrays import BanArrays, BatchProcessors, ProcessorArrays, batch_processors, step_bans
from rlserve.worker.upload import ArrayT, upload_groups


class SamplingArrays(NamedTuple, Generic[ArrayT]):
    """One step's sampling inputs: host arrays in the step's upload, then device tensors
    under the same names."""

    temperature: ArrayT  # float32 [R], 0 = greedy
    top_p: ArrayT  # float32 [R]
    min_p: ArrayT  # float32 [R]
    top_k: ArrayT  # int64 [R], 0 = off
    noise_seeds: ArrayT | None  # int64 [R] Philox keys (fused sampling only)
    processors: ProcessorArrays[ArrayT] | None  # None: no allow-list, bias or penalty in the batch
    bans: BanArrays[ArrayT] | None  # None: no ban
    history: HistoryArrays[ArrayT] | None  # the penalties' token history (rlserve.worker.penalties)

    @property
    def processes(self) -> bool:
        """Some row's logits are processed this step (S.LogitsProcessing)."""
        return self.processors is not None or self.bans is not None or self.history is not None


class SamplingRows(NamedTuple):
    """A batch's sampling parameters that depend only on its requests, as host arrays
    and flags."""

    requests: list  # the Request of each row
    temperature: np.ndarray  # float32
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    top_k: np.ndarray  # int64, 0 = off
    seeded_rows: list[int]
    min_tokens_rows: list[int]
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_logprobs: int
    processors: BatchProcessors | None  # None: no row has logits processors


class SamplingStep(NamedTuple):
    """One step's sampling inputs on the host."""

    rows: SamplingRows
    seeds: list[tuple[int, int]]  # (row, per-token seed) of the seeded rows
    plan: PenaltyPlan | None
    arrays: SamplingArrays[np.ndarray]


class _Bitmask(NamedTuple, Generic[ArrayT]):
    rows: ArrayT  # int64 rows with a grammar mask
    words: ArrayT  # int32 [rows, ceil(V / 32)]


class SamplingInputs:
    """Builds the sampler's inputs for a batch's sampling rows, step after step; keeps
    the penalties' token history on the device between steps."""

    def __init__(self, vocab_size: int, device: torch.device, processed_logprobs: bool):
        self.device = device
        self.processed_logprobs = processed_logprobs
        self.penalties = PenaltyHistory(vocab_size, device)
        self._noise_rng = np.random.default_rng()  # keys of unseeded rows (fused sampling)
        self._cache: SamplingRows | None = None  # see `_rows`

    def host_step(self, reqs: list, fused: bool) -> SamplingStep:
        """Host half: this step's sampling arrays for the upload. `fused`: the kernel set
        samples plain temperature rows (Gumbel-max), which takes a noise key per row."""
        rows = self._rows(reqs)
        seeds = _seeds(rows)
        bans = step_bans(rows.requests, rows.min_tokens_rows, rows.processors)
        noise = self._noise_keys(len(reqs), seeds) if fused else None
        plan = self._penalty_plan(rows)
        arrays = SamplingArrays(
            rows.temperature,
            rows.top_p,
            rows.min_p,
            rows.top_k,
            noise,
            None if rows.processors is None else rows.processors.arrays,
            bans,
            None if plan is None else plan.arrays,
        )
        return SamplingStep(rows, seeds, plan, arrays)

    def device_batch(
        self, step: SamplingStep, t: SamplingArrays[torch.Tensor], last_tokens: torch.Tensor | None
    ) -> S.SamplingBatch:
        """Device half: the SamplingBatch from the step's uploaded arrays `t`;
        `last_tokens`: each row's newest token, on the device (needed when t.processes)."""
        rows = step.rows
        processing = None
        if t.processes:
            assert last_tokens is not None, "processed rows need their newest tokens"
            processing = self._processing(step, t, last_tokens)
        return S.SamplingBatch(
            temperature=t.temperature,
            top_p=t.top_p,
            min_p=t.min_p,
            top_k=t.top_k,
            seeds=step.seeds,
            all_greedy=rows.all_greedy,
            any_greedy=rows.any_greedy,
            need_top_k=rows.need_top_k,
            need_top_p=rows.need_top_p,
            need_min_p=rows.need_min_p,
            max_logprobs=rows.max_logprobs,
            noise_seeds=t.noise_seeds,
            processing=processing,
            processed_logprobs=self.processed_logprobs,
        )

    def batch(self, reqs: list, fused: bool, last_tokens: torch.Tensor | None = None) -> S.SamplingBatch:
        """The sampler's inputs for rows `reqs` on their own (a step builds the same within
        its upload); `last_tokens`: each row's newest token, on the device (by default the
        newest of its token_ids)."""
        step = self.host_step(reqs, fused)
        if last_tokens is None and step.arrays.processes:
            last_tokens = torch.tensor([r.token_ids[-1] for r in reqs], device=self.device)
        (t,) = upload_groups((step.arrays,), self.device)
        return self.device_batch(step, t, last_tokens)

    def with_bitmask(self, batch: S.SamplingBatch, token_bitmask: torch.Tensor | np.ndarray) -> S.SamplingBatch:
        """`batch` under grammar masks: `token_bitmask` [rows, ceil(V / 32)] int32 on the
        host, one row per sampling row; rows with every bit set cost nothing."""
        mask = np.asarray(token_bitmask, dtype=np.int32)
        rows = np.flatnonzero((mask != -1).any(axis=1))
        if not rows.size:
            return batch
        bitmask: _Bitmask[np.ndarray] = _Bitmask(rows.astype(np.int64), np.ascontiguousarray(mask[rows]))
        (t,) = upload_groups((bitmask,), self.device)
        return dataclasses.replace(
            batch, token_bitmask=t.words, token_bitmask_rows=None if rows.size == mask.shape[0] else t.rows
        )

    def _rows(self, reqs: list) -> SamplingRows:
        """The sampling rows' parameters. A request's never change (Request.sampling_row),
        so while the batch holds the same requests in the same order, as it does from one
        decode step to the next, the previous step's arrays are reused."""
        cached = self._cache
        if cached is not None and cached.requests == reqs:  # Request compares by identity
            return cached
        n, width = len(reqs), len(SamplingRow._fields)
        table = np.fromiter(
            itertools.chain.from_iterable(r.sampling_row for r in reqs), dtype=np.float64, count=n * width
        ).reshape(n, width)
        # Each field's column, under its name: arrays where a SamplingRow holds scalars.
        col: Any = SamplingRow._make(table.T)
        greedy = col.temperature == 0
        processor_rows = np.flatnonzero(col.has_processors).tolist()
        self._cache = SamplingRows(
            reqs,
            col.temperature.astype(np.float32),
            col.top_p.astype(np.float32),
            col.min_p.astype(np.float32),
            col.top_k.astype(np.int64),
            np.flatnonzero(col.seeded).tolist(),
            np.flatnonzero(col.min_tokens).tolist(),
            bool(greedy.all()),
            bool(greedy.any()),
            bool((col.top_k > 0).any()),
            bool((col.top_p < 1).any()),
            bool((col.min_p > 0).any()),
            int(col.logprobs.max()),
            batch_processors(reqs, processor_rows) if processor_rows else None,
        )
        return self._cache

    def _noise_keys(self, num_rows: int, seeds: list[tuple[int, int]]) -> np.ndarray:
        """One Philox key per row for fused sampling: the row's per-token seed, or a fresh
        random one."""
        keys = self._noise_rng.integers(0, 1 << 62, size=num_rows, dtype=np.int64)
        for i, seed in seeds:
            keys[i] = seed
        return keys

    def _penalty_plan(self, rows: SamplingRows) -> PenaltyPlan | None:
        """The penalty rows' token history for this step (rlserve.worker.penalties)."""
        proc = rows.processors
        if proc is None or not proc.penalty_requests:
            if self.penalties.requests:
                self.penalties.reset()
            return None
        return self.penalties.plan(proc.penalty_requests, proc.needs_prompt)

    def _processing(
        self, step: SamplingStep, t: SamplingArrays[torch.Tensor], last_tokens: torch.Tensor
    ) -> S.LogitsProcessing:
        """The step's LogitsProcessing from its uploaded arrays `t` (see batch_processors,
        step_bans and _penalty_plan); `last_tokens`: each row's newest token."""
        out = S.LogitsProcessing(last_tokens=last_tokens)
        p = t.processors
        if p is not None:
            out.allowed, out.bias = p.allowed, p.bias
        if t.bans is not None:
            out.bans, out.ban_after = (t.bans.rows, t.bans.tokens), t.bans.after
        if step.plan is not None:
            proc = step.rows.processors
            # A penalty plan is made for the rows with penalties (_penalty_plan), whose
            # arrays and history travel with it.
            assert proc is not None and p is not None and p.penalties is not None and t.history is not None
            pen = p.penalties
            counts, prompt_mask = self.penalties.build(
                step.plan, t.history, last_tokens if pen.rows is None else last_tokens[pen.rows]
            )
            out.penalties = S.Penalties(
                rows=pen.rows,
                repetition=pen.repetition.view(-1, 1),
                frequency=pen.frequency.view(-1, 1),
                presence=pen.presence.view(-1, 1),
                counts=counts,
                prompt_mask=prompt_mask,
                any_repetition=bool(proc.needs_prompt.any()),
                any_frequency=proc.any_frequency,
                any_presence=proc.any_presence,
            )
        return out


def _seeds(rows: SamplingRows) -> list[tuple[int, int]]:
    """What depends on the step besides its bans (processor_arrays.step_bans): each seeded
    row's per-token seed."""
    seeds = []
    for i in rows.seeded_rows:
        req = rows.requests[i]
        seeds.append(
            (i, S.mix_seed(req.sampling_params.seed, req.sample_index, len(req.token_ids) - req.num_prompt_tokens))
        )
    return seeds
