"""Tensor-parallel layers.

Each layer holds its rank's shard and says, per parameter, which slice of the full HF
tensor that shard is (`Shard`). Checkpoint loading and live updates both go through
`CausalLM.load_weights`, which reads those slices, so a full tensor from a checkpoint or
a trainer lands in every rank's shard the same way. With one rank the layers are plain
linear/embedding layers and never communicate.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.distributed import TPGroup, current_tp_group, split_evenly
from rlserve.ops.kernels import TORCH, Kernels


class Shard(NamedTuple):
    """Indices [start, start + size) along `dim` of a full tensor whose size there is `full`."""

    dim: int
    start: int
    size: int
    full: int


class ShardedModule(nn.Module):
    """A module whose parameters may hold only part of their HF tensors."""

    def weight_shards(self, leaf: str) -> list[Shard | None]:
        """The HF tensors parameter `leaf` is made of, in the order they are stacked along
        their split dim (fused layers stack several); None: the whole tensor, replicated."""
        raise NotImplementedError


class ColumnParallelLinear(ShardedModule):
    """y = x W^T + b with the output features split across ranks; y stays split.

    `outputs` lists, per fused piece (q, k, v or gate, up), this rank's rows of it; the
    pieces are stacked in that order, so a fused projection splits into the same pieces
    on every rank.
    """

    kernels: Kernels = TORCH  # the worker binds its set (its `linear`)

    def __init__(self, in_features: int, outputs: list[Shard], bias: bool):
        super().__init__()
        assert all(s.dim == 0 for s in outputs)
        self.outputs = outputs
        out_features = sum(s.size for s in outputs)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.lora = None  # a LoRALayer once rlserve.model.lora.attach_lora ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora(y, x)
        return y

    def weight_shards(self, leaf: str) -> list[Shard | None]:
        return list(self.outputs)


class RowParallelLinear(ShardedModule):
    """y = x W^T + b with the input features split across ranks: each rank multiplies its
    slice of x, an all-reduce sums the partial products, then the (replicated) bias is
    added once. `reduce_results=False` leaves the partial products to a caller that sums
    several of them in one all-reduce (an MoE layer's shared expert)."""

    kernels: Kernels = TORCH

    def __init__(self, inputs: Shard, out_features: int, bias: bool, tp: TPGroup | None = None,
                 reduce_results: bool = True):
        super().__init__()
        self.tp = tp or current_tp_group()
        if bias and not reduce_results:
            raise ValueError("RowParallelLinear: a bias needs reduce_results (it is added once, after the sum)")
        self.reduce_results = reduce_results
        self.inputs = Shard(1, inputs.start, inputs.size, inputs.full)
        self.weight = nn.Parameter(torch.empty(out_features, inputs.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.lora = None  # a LoRALayer once rlserve.model.lora.attach_lora ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1 or not self.reduce_results:
            y = self.kernels.linear(x, self.weight, self.bias)
            if self.lora is not None:
                self.lora(y, x)
            return y
        out = self.kernels.linear(x, self.weight)
        if self.lora is not None:
            self.lora(out, x)  # this rank's partial delta: the all-reduce sums them
        out = self.tp.all_reduce(out)
        return out + self.bias if self.bias is not None else out

    def weight_shards(self, leaf: str) -> list[Shard | None]:
        return [self.inputs] if leaf == "weight" else [None]


def vocab_shard(vocab_size: int, tp: TPGroup) -> Shard:
    start, size = split_evenly(vocab_size, tp.world_size, tp.rank)
    return Shard(0, start, size, vocab_size)


class VocabParallelEmbedding(ShardedModule):
    """Embedding rows split across ranks: each rank looks up the ids in its range, zeros
    the rest, and an all-reduce assembles the full embeddings."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or current_tp_group()
        self.shard = vocab_shard(vocab_size, self.tp)
        self.weight = nn.Parameter(torch.empty(self.shard.size, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.shard.start
        inside = (local >= 0) & (local < self.shard.size)
        out = F.embedding(local.masked_fill(~inside, 0), self.weight)
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def weight_shards(self, leaf: str) -> list[Shard | None]:
        return [self.shard]


class ParallelLMHead(ShardedModule):
    """The output projection with vocabulary rows split across ranks. Every rank gets
    the full logits (an all-gather), so any rank can sample."""

    kernels: Kernels = TORCH

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or current_tp_group()
        self.shard = vocab_shard(vocab_size, self.tp)
        self.sizes = [split_evenly(vocab_size, self.tp.world_size, r)[1] for r in range(self.tp.world_size)]
        self.weight = nn.Parameter(torch.empty(self.shard.size, dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(self.kernels.linear(hidden, self.weight), self.sizes)

    def weight_shards(self, leaf: str) -> list[Shard | None]:
        return [self.shard]
