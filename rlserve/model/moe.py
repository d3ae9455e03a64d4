"""Mixture-of-experts layers: the router, the stacked experts, the sparse MLP block.

Experts are stored stacked per layer, `w13 [E, 2I, H]` (gate rows, then up rows) and
`w2 [E, H, I]`, with I this rank's slice of every expert's intermediate dimension; the
router is replicated and every rank routes the same way, so one all-reduce a layer sums
the experts' partial outputs (and a shared expert's), as a dense MLP's down_proj does.

Names arrive in two layouts, and both load, on disk and live, in any mix:
- per expert, as checkpoints hold them: `experts.{e}.gate_proj.weight` (`w1` in Mixtral),
  `up_proj` (`w3`), `down_proj` (`w2`);
- stacked, as transformers 5's `named_parameters` gives them: `experts.gate_up_proj
  [E, 2I, H]`, `experts.down_proj [E, H, I]`.
`FusedMoE.weight_slots` maps each name onto (parameter, expert, slices) once; a stacked
name covers the per-expert names it holds (base.py). The kernels read `w13`/`w2` as they
are stored, so every update lands on the layout the next step reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from rlserve.distributed import current_tp_group, split_evenly
from rlserve.model.base import Piece, WeightSlot
from rlserve.model.parallel import ColumnParallelLinear, RowParallelLinear, Shard
from rlserve.ops.kernels import TORCH, Kernels


def config_value(config, *names: str, default=None):
    """The first of `names` the config sets (transformers 5 and 4.x spell some fields
    differently, e.g. num_experts / num_local_experts)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


class MoEConfig(NamedTuple):
    """What an MoE architecture's config says about its sparse layers."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    renormalize: bool  # norm_topk_prob
    sparse_step: int = 1  # decoder_sparse_step: every n-th layer is sparse
    dense_layers: frozenset[int] = frozenset()  # mlp_only_layers
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none

    @classmethod
    def read(cls, config, renormalize: bool | None = None) -> MoEConfig:
        """`renormalize`: fixed by the architecture (Mixtral always), else norm_topk_prob."""
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: mixture-of-experts layers support silu, got {act!r}")
        moe = cls(
            num_experts=int(config_value(config, "num_experts", "num_local_experts", default=0)),
            top_k=int(config_value(config, "num_experts_per_tok", default=0)),
            intermediate_size=int(config_value(config, "moe_intermediate_size", "intermediate_size")),
            renormalize=bool(config_value(config, "norm_topk_prob", default=False)
                             if renormalize is None else renormalize),
            sparse_step=int(config_value(config, "decoder_sparse_step", default=1)),
            dense_layers=frozenset(config_value(config, "mlp_only_layers", default=())),
            shared_intermediate_size=int(config_value(config, "shared_expert_intermediate_size", default=0)))
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ValueError(f"num_experts_per_tok: must be in 1..num_experts ({moe.num_experts}), "
                             f"got {moe.top_k}")
        if moe.sparse_step < 1:
            raise ValueError(f"decoder_sparse_step: must be >= 1, got {moe.sparse_step}")
        return moe

    def is_sparse(self, layer: int) -> bool:
        """transformers' rule for which decoder layers are MoE layers."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


class ExpertNames(NamedTuple):
    """How an architecture's checkpoints name one expert's projections."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    # The checkpoint's name for the block where it differs from transformers 5's `mlp`.
    block: str | None = None


def unstack_experts(named, names: ExpertNames = ExpertNames()):
    """(name, tensor) pairs with transformers 5's stacked experts (`experts.gate_up_proj`
    [E, 2I, H], `experts.down_proj` [E, H, I]) rewritten as a checkpoint's per-expert names,
    as views: what a trainer holding stacked experts sends when it wants checkpoint names."""
    for name, t in named:
        base = name.rpartition(".")[0]
        if names.block is not None:
            base = base.replace(".mlp.", f".{names.block}.")
        if name.endswith("experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}.{e}.{names.gate}.weight", t[e, :half]
                yield f"{base}.{e}.{names.up}.weight", t[e, half:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                yield f"{base}.{e}.{names.down}.weight", t[e]
        else:
            yield name, t


class FusedMoE(nn.Module):
    """One layer's routed experts, stacked: w13 [E, 2I_shard, H], w2 [E, H, I_shard]."""

    kernels: Kernels = TORCH

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 names: ExpertNames = ExpertNames()):
        super().__init__()
        tp = current_tp_group()
        start, size = split_evenly(intermediate_size, tp.world_size, tp.rank)
        self.shard = Shard(0, start, size, intermediate_size)
        self.num_experts, self.hidden_size, self.names = num_experts, hidden_size, names
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, size))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the routed experts' weighted outputs."""
        return self.kernels.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)

    def weight_slots(self, module_name: str) -> Iterator[tuple[str, list[tuple[str, WeightSlot]]]]:
        e, h, (_, start, size, full) = self.num_experts, self.hidden_size, self.shard
        gate, up = Piece(0, start, size, 0), Piece(0, start, size, size)
        down = Piece(1, start, size, 0)
        per_expert = module_name
        if self.names.block is not None:  # e.g. model.layers.0.mlp.experts -> ...block_sparse_moe.experts
            layer = module_name.rsplit(".", 2)[0]
            per_expert = f"{layer}.{self.names.block}.experts"
        n = self.names
        gate_names = [f"{per_expert}.{x}.{n.gate}.weight" for x in range(e)]
        up_names = [f"{per_expert}.{x}.{n.up}.weight" for x in range(e)]
        down_names = [f"{per_expert}.{x}.{n.down}.weight" for x in range(e)]
        w13 = [(f"{module_name}.gate_up_proj", WeightSlot(
            "", (e, 2 * full, h), (gate._replace(dim=1), up._replace(dim=1, start=full + start)),
            covers=(*gate_names, *up_names)))]
        w13 += [(name, WeightSlot("", (full, h), (gate,), x)) for x, name in enumerate(gate_names)]
        w13 += [(name, WeightSlot("", (full, h), (up,), x)) for x, name in enumerate(up_names)]
        w2 = [(f"{module_name}.down_proj", WeightSlot("", (e, h, full), (down._replace(dim=2),),
                                                      covers=tuple(down_names)))]
        w2 += [(name, WeightSlot("", (h, full), (down,), x)) for x, name in enumerate(down_names)]
        yield "w13", w13
        yield "w2", w2


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a gated MLP every token goes through, scaled by a
    sigmoid gate; its down projection is left unreduced, for the block's one all-reduce."""

    kernels: Kernels = TORCH

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        tp = current_tp_group()
        inner = Shard(0, *split_evenly(intermediate_size, tp.world_size, tp.rank), intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [inner, inner], bias=False)
        self.down_proj = RowParallelLinear(inner, hidden_size, bias=False, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the shared expert, as transformers' sparse
    MoE blocks compute them; the decoder layer's MLP in its sparse layers."""

    # Adapters on expert or router weights are refused (model/lora.py reads this).
    lora_exempt = True
    kernels: Kernels = TORCH  # the router's and the shared expert gate's GEMMs (`linear`)

    def __init__(self, config, moe: MoEConfig, names: ExpertNames = ExpertNames()):
        super().__init__()
        self.tp = current_tp_group()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)  # the router, replicated
        self.experts = FusedMoE(moe.num_experts, config.hidden_size, moe.intermediate_size, names)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        self.layer_index = 0  # the decoder layer it is the MLP of (its column of routes)
        # Routing capture (model/routed_experts.py): [max_tokens, top_k] int32, this
        # layer's column of the step's routes; None: not captured
        self.capture: torch.Tensor | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = SharedExpert(config.hidden_size, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.kernels.route(self.kernels.linear(x, self.gate.weight), self.top_k, self.renormalize)
        if self.capture is not None:
            self.capture[:x.shape[0]].copy_(routing.ids)
        out = self.experts(x, routing.weights, routing.ids)
        shared, gate = self.shared_expert, self.shared_expert_gate
        if shared is not None and gate is not None:
            # Scaling each rank's partial by the same per-token gate commutes with the sum.
            out = out + torch.sigmoid(self.kernels.linear(x, gate.weight)) * shared(x)
        return self.tp.all_reduce(out)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(block(x) + residual): the decoder layer's MLP step (see LlamaMLP's)."""
        return norm(self(x), residual)
