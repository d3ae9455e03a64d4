"""Turns a scheduled batch into tensors, runs the model over the paged cache, samples."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import numpy as np
import torch

from rlserve.engine.request import TokenLogprob
from rlserve.engine.scheduler import SchedulerOutput
from rlserve.model.base import CausalLM
from rlserve.model.layers import AttentionMetadata, PagedAttention
from rlserve.worker import sampler as S

logger = logging.getLogger(__name__)


@dataclass
class SampledToken:
    request_id: str
    token_id: int
    logprob: TokenLogprob | None


@dataclass
class ModelRunnerOutput:
    sampled: list[SampledToken]
    # request id -> logprobs of the prompt tokens this step covered, in order
    prompt_logprobs: dict[str, list[TokenLogprob]]


PLACEHOLDER = -1  # a token sampled by the step still in flight (overlapped scheduling)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that need logits
    sample_rows: list[int]  # index into logits_indices of each sampling request
    sample_requests: list  # ScheduledRequest that sample, aligned with sample_rows
    prompt_rows: dict[str, tuple[int, list[int]]]  # req id -> (first logits row, target ids)


@dataclass
class StepHandle:
    """A launched step: its results still on the device until `collect`."""

    sample_requests: list  # ScheduledRequest, aligned with the rows of `sampled`
    sampled: S.SamplerOutput | None
    prompt: dict[str, tuple[list[int], int, tuple]]  # req id -> (targets, k, device stats)
    prompt_start: dict[str, int]  # req id -> position the step's chunk started at

    def row_of(self) -> dict[str, int]:
        return {item.request.request_id: i for i, item in enumerate(self.sample_requests)}


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype, block_size: int):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.attn_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.graphs: CudaGraphs | None = None
        self.fused_sampling = self._check_fused_sampling()
        self._rng = random.Random()

    def _check_fused_sampling(self) -> bool:
        """Use the fused sampling kernel on CUDA, once it has run correctly here."""
        from rlserve.ops.backend import uses_triton
        if not uses_triton(self.device):
            return False
        try:
            from rlserve.ops.triton_sampling import gumbel_sample
            logits = torch.full((2, 300), -30.0, device=self.device)
            logits[:, 257] = 30.0
            ok = gumbel_sample(logits, torch.ones(2, device=self.device),
                               torch.tensor([1, 2], device=self.device)).tolist() == [257, 257]
        except Exception as e:  # an old or broken Triton: the torch sampler still works
            logger.warning("fused sampling disabled: %s: %s", type(e).__name__, e)
            return False
        if not ok:
            logger.warning("fused sampling disabled: the kernel failed its self-check")
        return ok

    # -- KV cache --------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        a = self.attn_layers[0]
        per_layer = 2 * self.block_size * a.num_kv_heads * a.head_dim
        return per_layer * len(self.attn_layers) * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        a = self.attn_layers[0]
        self.kv_cache = torch.empty(
            (len(self.attn_layers), 2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim),
            dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.num_blocks = num_blocks

    def free_kv_cache(self) -> None:
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = None
        self.kv_cache = None
        self.graphs = None  # they captured the cache's addresses

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode steps for a ladder of batch sizes; see CudaGraphs."""
        from rlserve.ops.backend import uses_triton
        if self.device.type != "cuda" or not uses_triton(self.device):
            return  # the torch reference ops read tensors on the host: not capturable
        self.graphs = CudaGraphs(self, min(max_num_seqs, 512), max_model_len)

    # -- inputs ------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, block_tables: list[list[int]],
                prev: StepHandle | None = None) -> BatchInputs:
        """Flatten the scheduled chunks into one batch. Tokens still being sampled by the
        in-flight step `prev` are filled in on the device, without waiting for it."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        sample_requests = []
        prompt_rows: dict[str, tuple[int, list[int]]] = {}
        fill_at: list[int] = []  # flat positions whose token comes from prev
        fill_from: list[int] = []
        prev_rows = prev.row_of() if prev is not None else {}
        flat = 0
        for item, table in zip(sched.scheduled, block_tables):
            req, n = item.request, item.num_new_tokens
            start = req.num_computed_tokens
            end = start + n
            if n == 1:  # decode: the common case, kept lean
                tok = req.token_ids[start]
                input_ids.append(tok)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(req.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                tok = input_ids[-1]
            if tok == PLACEHOLDER:
                fill_at.append(flat + n - 1)
                fill_from.append(prev_rows[req.request_id])
            qsl.append(flat + n)
            seq_lens.append(end)
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                # Position p predicts token p + 1; the prompt's first token has no logprob.
                last = min(end, req.num_prompt_tokens - 1)
                if last > start:
                    prompt_rows[req.request_id] = (len(logits_indices), req.token_ids[start + 1:last + 1])
                    logits_indices.extend(range(flat, flat + last - start))
            if item.samples:
                sample_rows.append(len(logits_indices))
                sample_requests.append(item)
                logits_indices.append(flat + n - 1)
            flat += n
        tables = np.zeros((len(block_tables), max(map(len, block_tables))), dtype=np.int64)
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = t
        (ids, pos, slot_t, qsl_t, lens_t, logit_t, at_t, from_t, tables_t) = self.upload(
            [input_ids, positions, slots, qsl, seq_lens, logits_indices, fill_at, fill_from, tables])
        if fill_at:
            ids[at_t] = prev.sampled.token_ids[from_t]
        meta = AttentionMetadata(
            slot_mapping=slot_t, query_start_loc=qsl_t.to(torch.int32), seq_lens=lens_t.to(torch.int32),
            block_tables=tables_t.view(tables.shape).to(torch.int32),
            max_query_len=max(item.num_new_tokens for item in sched.scheduled),
            max_seq_len=max(seq_lens))
        return BatchInputs(input_ids=ids, positions=pos, meta=meta, logits_indices=logit_t,
                           sample_rows=sample_rows, sample_requests=sample_requests,
                           prompt_rows=prompt_rows)

    def upload(self, arrays: list, dtype=torch.int64) -> list[torch.Tensor]:
        """Host lists -> device tensors in one copy from page-locked memory.

        A copy from pageable memory would make the host wait for the device's queue to
        drain, which is exactly what overlapped scheduling must avoid.
        """
        np_dtype = np.int64 if dtype == torch.int64 else np.float32
        parts = [np.asarray(a, dtype=np_dtype).ravel() for a in arrays]
        total = sum(p.size for p in parts)
        host = torch.empty(max(total, 1), dtype=dtype, pin_memory=self.device.type == "cuda")
        flat = host.numpy()
        offsets = [0]
        for p in parts:
            flat[offsets[-1]:offsets[-1] + p.size] = p
            offsets.append(offsets[-1] + p.size)
        dev = host.to(self.device, non_blocking=True)
        return [dev[a:b] for a, b in zip(offsets, offsets[1:])]

    def _sampling_batch(self, items) -> S.SamplingBatch:
        temps, top_p, top_k, min_p, seeds, banned = [], [], [], [], [], []
        max_lp = -1
        for item in items:
            req = item.request
            p = req.sampling_params
            temps.append(p.temperature)
            top_p.append(p.top_p)
            top_k.append(max(p.top_k, 0))
            min_p.append(p.min_p)
            seeds.append(None if p.seed is None else
                         S.mix_seed(p.seed, req.sample_index, req.num_output_tokens))
            ban: list[int] = []
            if req.num_output_tokens < p.min_tokens:
                ban = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
            banned.append(ban)
            if p.logprobs is not None:
                max_lp = max(max_lp, p.logprobs)
        temp_t, top_p_t, min_p_t, top_k_t = self.upload([temps, top_p, min_p, top_k], torch.float32)
        noise_seeds = None
        if self.fused_sampling:
            rng = self._rng
            noise_seeds = self.upload([[rng.getrandbits(62) if s is None else s for s in seeds]])[0]
        return S.SamplingBatch(
            temperature=temp_t, top_p=top_p_t, top_k=top_k_t.to(torch.int64), min_p=min_p_t,
            seeds=seeds, banned=banned,
            all_greedy=all(t == 0 for t in temps), any_greedy=any(t == 0 for t in temps),
            noise_seeds=noise_seeds,
            need_top_k=any(k > 0 for k in top_k),
            need_top_p=any(p < 1 for p in top_p), need_min_p=any(m > 0 for m in min_p),
            max_logprobs=max_lp)

    # -- the step ----------------------------------------------------------------------
    def forward(self, batch: BatchInputs, decode_only: bool) -> torch.Tensor:
        n = batch.input_ids.shape[0]
        if decode_only and self.graphs is not None and n <= self.graphs.max_batch:
            return self.graphs.run(batch)
        return self.model(batch.input_ids, batch.positions, batch.meta)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, block_tables: list[list[int]],
               prev: StepHandle | None = None) -> StepHandle:
        """Queue the step on the device; nothing here waits for the device."""
        batch = self.prepare(sched, block_tables, prev)
        hidden = self.forward(batch, decode_only=batch.meta.max_query_len == 1)
        if not batch.logits_indices.numel():
            return StepHandle([], None, {}, {})
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampled = None
        if batch.sample_rows:
            if len(batch.sample_rows) == logits.shape[0]:  # every row samples: no gather
                rows_logits = logits
            else:
                rows_logits = logits[self.upload([batch.sample_rows])[0]]
            sampled = S.sample(rows_logits, self._sampling_batch(batch.sample_requests))
        prompt, prompt_start = {}, {}
        for rid, (first, targets) in batch.prompt_rows.items():
            req = next(it.request for it in sched.scheduled if it.request.request_id == rid)
            k = req.sampling_params.prompt_logprobs
            lp = S.raw_logprobs(logits[first:first + len(targets)])
            prompt[rid] = (targets, k, S.logprob_stats(lp, torch.tensor(targets, device=lp.device), k))
            prompt_start[rid] = req.num_computed_tokens
        return StepHandle(batch.sample_requests, sampled, prompt, prompt_start)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Bring a launched step's results to the host: the one sync of a step."""
        sampled: list[SampledToken] = []
        if handle.sampled is not None:
            token_ids = handle.sampled.token_ids.tolist()
            ks = [it.request.sampling_params.logprobs for it in handle.sample_requests]
            lps = self._to_logprobs(handle.sampled, token_ids, ks)
            sampled = [SampledToken(it.request.request_id, tok, lp)
                       for it, tok, lp in zip(handle.sample_requests, token_ids, lps)]
        prompt_lps = {rid: self._pack_logprobs(targets, *stats, [k] * len(targets))
                      for rid, (targets, k, stats) in handle.prompt.items()}
        return ModelRunnerOutput(sampled, prompt_lps)

    def execute(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> ModelRunnerOutput:
        return self.collect(self.launch(sched, block_tables))

    def _to_logprobs(self, out: S.SamplerOutput, tokens: list[int],
                     ks: list[int | None]) -> list[TokenLogprob | None]:
        if out.logprobs is None:
            return [None] * len(ks)
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

    Inputs are copied into static buffers; padded rows write nowhere (slot -1) and attend
    to one key of block 0, so their (discarded) outputs cost almost nothing. Weight updates
    copy into the same parameter storage, so the graphs stay valid across them.
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
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: smaller ones reuse its pool
                meta = self._meta(size)
                args = (self.input_ids[:size], self.positions[:size], meta)
                runner.model(*args)  # compiles kernels outside the capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = runner.model(*args)
                pool = graph.pool()
                self.graphs[size] = (graph, out)
        torch.cuda.synchronize(dev)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(self.slots[:size], self.qsl[:size + 1], self.seq_lens[:size],
                                 self.tables[:size], 1, self.max_model_len)

    def run(self, batch: BatchInputs) -> torch.Tensor:
        n = batch.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        m = batch.meta
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(m.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.seq_lens[:n].copy_(m.seq_lens)
        self.seq_lens[n:size].fill_(1)
        width = m.block_tables.shape[1]
        self.tables[:n, :width].copy_(m.block_tables)
        self.tables[n:size, 0].fill_(0)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
