"""Decode steps replayed from CUDA graphs, one graph per padded batch size."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from rlserve.model.base import CausalLM
from rlserve.model.gated_deltanet import StateBatch
from rlserve.model.layers import AttentionMetadata
from rlserve.ops.lora import LoRABatch

if TYPE_CHECKING:
    from rlserve.model.lora import LoRAModel


class CudaGraphs:
    """Decode steps replayed from CUDA graphs: one graph per padded batch size.

    Inputs are copied into static buffers (one kernel, ops/triton_graph_inputs.py); padded
    rows write nowhere (slot -1) and attend to one key of block 0, so their (discarded)
    outputs cost almost nothing. A hybrid model's graphs also read each row's state slot
    from a buffer; padding rows use the pool's spare slot. Weight updates copy into the same
    parameter storage, so the graphs stay valid across them.
    """

    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        block_size: int,
        lora: LoRAModel | None,
        max_batch: int,
        max_model_len: int,
        largest_only: bool = False,
        state_pad: int | None = None,
    ) -> None:
        """`lora`: the model's adapters, or None. `largest_only`: capture
        the largest batch alone (memory profiling: the smaller graphs share its pool).
        `state_pad`: a hybrid model's padding state slot (gated_deltanet.pad_slot), else None."""
        self.model = model
        self.max_model_len = max_model_len
        self.sizes = (
            [max_batch]
            if largest_only
            else sorted({s for s in [1, 2, 4, 8] + list(range(16, max_batch + 1, 16)) if s <= max_batch} | {max_batch})
        )
        self.max_batch = self.sizes[-1]
        dev = device
        max_blocks = -(-max_model_len // block_size)
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=dev)
        self.order = torch.arange(b, dtype=torch.int32, device=dev)
        self.state_pad = state_pad
        if state_pad is not None:  # each row's state slot, and whether it starts from zero
            self.state_slots = torch.full((b,), state_pad, dtype=torch.int64, device=dev)
            self.state_fresh = torch.zeros(b, dtype=torch.bool, device=dev)
        # Graphs run only with the Triton kernel set (Kernels.graphs): triton imports here.
        from rlserve.ops.triton_graph_inputs import stage_graph_inputs

        self.stage = stage_graph_inputs  # a step's rows into these buffers, padding rows after
        if lora is not None:  # the step's token grouping by adapter (padded rows in no slot)
            self.lora_tokens = torch.zeros(b, dtype=torch.int32, device=dev)
            self.lora_starts = torch.zeros(lora.max_loras + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture(lora, dev)
        torch.cuda.synchronize(dev)

    def _capture(self, lora: LoRAModel | None, dev: torch.device) -> None:
        model, pool = self.model, None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: smaller ones reuse its pool
                meta = self._meta(size)
                args = (self.input_ids[:size], self.positions[:size], meta)
                if lora is not None:  # the LoRA kernels are captured reading the static buffers
                    lora.context.batch = LoRABatch(self.lora_tokens[:size], self.lora_starts)
                model(*args)  # compiles kernels outside the capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = model(*args)
                pool = graph.pool()
                self.graphs[size] = (graph, out)
                model.compute_logits(out)  # cuBLAS chooses its kernel for this shape now
            if lora is not None:
                lora.context.batch = None
            self._first_replays()

    def _first_replays(self) -> None:
        """Replay every graph once, on the padding rows the buffers hold (they write
        nowhere): a graph's first launch takes the host ~0.4 ms, later ones ~0.01 ms
        (H200), a stall that would otherwise land in the first step of each batch size."""
        for graph, _ in self.graphs.values():
            graph.replay()

    def size_for(self, n: int) -> int:
        """The batch size of the graph that runs n sequences (n <= max_batch)."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def lm_head_rows(self, n: int) -> int:
        """How many rows the LM head computes when n need logits: n rounded up to a graph's
        batch size (or to a multiple of 256 above the largest). cuBLAS spends host time
        choosing a kernel the first time it meets a shape (0.4-9 ms on an H200), which the
        eager prefill steps and the short steps at the end of a run cannot hide; a few
        shapes, met at capture, pay it once."""
        if n == 0:
            return n
        if n <= self.max_batch:
            return self.size_for(n)
        return -(-n // 256) * 256

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            self.slots[:size],
            self.qsl[: size + 1],
            self.seq_lens[:size],
            self.tables[:size],
            1,
            self.max_model_len,
            self.order[:size],
        )
        if self.state_pad is not None:
            meta.states = StateBatch.decode_rows(self.state_slots[:size], self.state_fresh[:size])
        return meta

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, m: AttentionMetadata, lora: LoRABatch | None
    ) -> torch.Tensor:
        """A decode step of len(input_ids) <= max_batch sequences (step_inputs.BatchInputs)."""
        n = input_ids.shape[0]
        size = self.size_for(n)
        assert m.seq_order is not None  # StepInputs orders every step's sequences
        self.stage(
            input_ids,
            positions,
            m.slot_mapping,
            m.seq_lens,
            m.seq_order,
            m.block_tables,
            self.input_ids,
            self.positions,
            self.slots,
            self.seq_lens,
            self.order,
            self.tables,
            size,
        )
        if self.state_pad is not None:
            assert m.states is not None  # the runner gives a hybrid model's steps their slots
            self.state_slots[:n].copy_(m.states.slots)
            self.state_slots[n:size].fill_(self.state_pad)
            self.state_fresh[:n].copy_(m.states.fresh)
            self.state_fresh[n:size].fill_(False)
        if lora is not None:
            self.lora_tokens[:n].copy_(lora.sorted_tokens)
            self.lora_starts.copy_(lora.slot_starts)
        graph, out = self.graphs[size]
        graph.replay()
        return out  # padded: the LM head takes the batch's graph size (lm_head_rows)
