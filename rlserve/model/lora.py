"""LoRA adapters on a model's linear layers, every adapter slot preallocated.

`attach_lora` gives each tensor-parallel linear layer (q/k/v/o and gate/up/down in the
Llama family, whatever ColumnParallelLinear / RowParallelLinear a model has) a
`LoRALayer`: its stacked adapter weights a [max_loras, slices, max_rank, in] and
b [max_loras, out, max_rank], zeros until an adapter is loaded into a slot. They are
allocated once, at start: loading, updating or removing an adapter copies into them, so
CUDA graphs captured over them stay valid. A fused layer (qkv_proj, gate_up_proj) has one
slice per projection it fuses, each with its own A and its rows of B.

More adapters than slots stay in host memory (`LoRAModel.host`, by name): each a copy of a
slot's tensors, swapped into a slot (`restore`) when the engine says, and out of it again
(`save`) when a push changed it there. A load or an update goes to a slot or to a host copy
alike (a `Target`).

Tensor parallelism: a column-parallel layer keeps A whole and its rows of each slice's B;
a row-parallel one keeps its columns of A and all of B. Each rank then adds its partial
delta before the layer's all-reduce, which sums them (the delta is linear in A's input
columns), so LoRA needs no communication of its own.

An adapter arrives as full (unsharded) PEFT tensors per HF module name, e.g.
"model.layers.0.self_attn.q_proj" -> (A [r, in], B [out, r]); its scaling is folded into B.
A rank below max_rank leaves the rest of the slot's rows zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from rlserve.model.parallel import ColumnParallelLinear, RowParallelLinear, Shard
from rlserve.ops.kernels import TORCH, Kernels
from rlserve.ops.lora import LoRABatch


class LoRAContext:
    """The step's LoRABatch, read by every LoRALayer of a model; None: no token of the step
    uses an adapter (eager steps then skip LoRA entirely)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
        self.kernels: Kernels = TORCH  # the model runner's set (its lora op)


class LoRALayer:
    """One linear layer's adapter weights (this rank's shard) for every slot."""

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, context: LoRAContext,
                 max_loras: int, max_rank: int):
        w = base.weight
        out_local, in_local = w.shape
        if isinstance(base, RowParallelLinear):
            self.slices = [(0, out_local)]
        else:
            offsets = [sum(s.size for s in base.outputs[:i]) for i in range(len(base.outputs))]
            self.slices = [(o, s.size) for o, s in zip(offsets, base.outputs)]
        self.context = context
        self.a = torch.zeros((max_loras, len(self.slices), max_rank, in_local), dtype=w.dtype, device=w.device)
        self.b = torch.zeros((max_loras, out_local, max_rank), dtype=w.dtype, device=w.device)
        self.slice_table = torch.tensor([[o for o, _ in self.slices], [n for _, n in self.slices]],
                                        dtype=torch.int32, device=w.device)

    def __call__(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += this step's adapter deltas, in place (nothing when no token has an adapter)."""
        batch = self.context.batch
        if batch is not None:
            self.context.kernels.lora(y, x, self.a, self.b, self.slices, self.slice_table, batch)


Target = int | str  # a device slot, or the name of an adapter's host copy


class LoRATarget(NamedTuple):
    """Where one HF module's adapter goes: slice `index` of `layer`, and which part of the
    full A / B this rank keeps (None: all of it)."""

    layer: LoRALayer
    index: int  # type: ignore[assignment]  # the field hides tuple.index, which nothing calls
    in_features: int  # full, as A [r, in_features]
    out_features: int  # full, as B [out_features, r]
    a_shard: Shard | None  # columns of A (row-parallel layers)
    b_shard: Shard | None  # rows of B (column-parallel layers)


class LoRAModel:
    """The adapter slots of one model (one tensor-parallel rank)."""

    def __init__(self, targets: dict[str, LoRATarget], context: LoRAContext, max_loras: int, max_rank: int,
                 exempt: tuple[str, ...] = ()):
        self.targets = targets
        self.exempt = exempt  # module name prefixes whose weights take no adapter (MoE blocks)
        self.context = context
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers = list({id(t.layer): t.layer for t in targets.values()}.values())
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        self.host: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # name -> (A, B) per layer

    def storage(self, target: Target) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (A, B) of a slot, or of an adapter's host copy (made on first use:
        pinned on CUDA, so copies to and from slots are plain DMA)."""
        if isinstance(target, str):
            copy = self.host.get(target)
            if copy is None:
                copy = self.host[target] = [(_host_like(layer.a[0]), _host_like(layer.b[0])) for layer in self.layers]
            return copy
        if not 0 <= target < self.max_loras:
            raise ValueError(f"lora slot {target} is outside 0..{self.max_loras - 1}")
        return [(layer.a[target], layer.b[target]) for layer in self.layers]

    @torch.no_grad()
    def save(self, slot: int, name: str) -> None:
        """The host copy of `name` takes what its slot holds (a push changed it there)."""
        host, device = self.storage(name), self.storage(slot)
        torch._foreach_copy_([t for pair in host for t in pair], [t for pair in device for t in pair])

    @torch.no_grad()
    def restore(self, name: str, slot: int) -> None:
        """`slot` takes the host copy of `name`, in place (CUDA graphs read the slots)."""
        host, device = self.storage(name), self.storage(slot)
        torch._foreach_copy_([t for pair in device for t in pair], [t for pair in host for t in pair])

    def drop(self, name: str) -> None:
        self.host.pop(name, None)

    def module_shapes(self, module: str, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The full shapes of `module`'s A and B at `rank`."""
        t = self.targets[module]
        return (rank, t.in_features), (t.out_features, rank)

    def load(self, target: Target, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
             scaling: Callable[[str], float]) -> None:
        """Put an adapter in `target`: modules absent from `pairs` get zeros. Every module,
        shape and rank is checked before anything is written, so a refusal changes nothing."""
        self.run(self.plan(target, pairs, scaling))

    def check(self, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Raise ValueError unless the model can take these (A, B) pairs: known modules,
        ranks within max_rank, shapes that match."""
        unknown = sorted(m for m in pairs if m not in self.targets)
        if unknown:
            raise ValueError(f"LoRA modules this model cannot adapt: {', '.join(unknown[:10])} "
                             f"(adaptable: q/k/v/o and gate/up/down projections, e.g. "
                             f"{next(iter(self.targets), '')})")
        for module, (a, b) in pairs.items():
            rank = a.shape[0]
            if rank > self.max_rank:
                raise ValueError(f"{module}: rank {rank} exceeds max_lora_rank ({self.max_rank})")
            want_a, want_b = self.module_shapes(module, rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ValueError(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not "
                                 f"match the model (expected {list(want_a)} and {list(want_b)})")

    def plan(self, target: Target, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
             scaling: Callable[[str], float]) -> LoadPlan:
        """Check an adapter against the model and work out the copies that put it in
        `target`. A plan stays valid while its source tensors do (a trainer's IPC views are
        the same tensors push after push), so a caller may keep it and `run` it again."""
        self.check(pairs)
        store = self.storage(target)
        plan = LoadPlan([], [], [], [], [], [])
        ranks: dict[tuple[int, int], int] = {}  # (layer, slice) -> the rank its copies fill
        for module, (a, b) in pairs.items():
            t = self.targets[module]
            rank = a.shape[0]
            ranks[id(t.layer), t.index] = rank
            if t.a_shard is not None:
                a = a.narrow(1, t.a_shard.start, t.a_shard.size)
            if t.b_shard is not None:
                b = b.narrow(0, t.b_shard.start, t.b_shard.size)
            offset, size = t.layer.slices[t.index]
            a_dst, b_dst = store[self._index[id(t.layer)]]
            plan.a_dst.append(a_dst[t.index, :rank])
            plan.a_src.append(a)
            plan.b_dst.append(b_dst[offset:offset + size, :rank])
            plan.b_src.append(b)
            plan.b_scales.append(scaling(module))
        plan.zero.extend(self._uncovered(store, ranks))
        return plan._replace(b_in_place=_exact_in_place(plan.b_dst, plan.b_src, plan.b_scales))

    def _uncovered(self, store: list[tuple[torch.Tensor, torch.Tensor]],
                   ranks: Mapping[tuple[int, int], int]) -> list[torch.Tensor]:
        """The parts of a target a load's copies leave (slices it has no module for, rows
        past each module's rank), which it clears: the copies and these cover it once.
        An adapter on every module at the full rank leaves nothing, so a push clears nothing."""
        out = []
        for layer, (a, b) in zip(self.layers, store):
            for i, (offset, size) in enumerate(layer.slices):
                rank = ranks.get((id(layer), i), 0)
                if rank < self.max_rank:
                    out.append(a[i, rank:])
                    out.append(b[offset:offset + size, rank:])
        return out

    @torch.no_grad()
    def run(self, plan: LoadPlan) -> None:
        """Clear what of the slot the copies leave, copy A, copy B times its scaling (a
        float32 product, rounded once into the layer's dtype). Multi-tensor ops: a handful
        of launches for the hundreds of small tensors an adapter has, where one copy each
        made the host the bottleneck."""
        if plan.zero:
            torch._foreach_zero_(plan.zero)
        if not plan.a_dst:
            return
        torch._foreach_copy_(plan.a_dst, plan.a_src)
        if plan.b_in_place:
            torch._foreach_copy_(plan.b_dst, plan.b_src)
            torch._foreach_mul_(plan.b_dst, plan.b_scales)
        else:
            torch._foreach_copy_(plan.b_dst, torch._foreach_mul([b.float() for b in plan.b_src], plan.b_scales))

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        torch._foreach_zero_([t for pair in self.storage(slot) for t in pair])


class LoadPlan(NamedTuple):
    """The copies that put one adapter in one slot (LoRAModel.plan)."""

    zero: list[torch.Tensor]  # what of the slot the copies leave (LoRAModel._uncovered)
    a_dst: list[torch.Tensor]
    a_src: list[torch.Tensor]
    b_dst: list[torch.Tensor]
    b_src: list[torch.Tensor]
    b_scales: list[float]
    # B copied as it is (cast to the slot's dtype), then scaled in place: see _exact_in_place.
    b_in_place: bool = False


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")


def _exact_in_place(dst: list[torch.Tensor], src: list[torch.Tensor], scales: list[float]) -> bool:
    """Whether copying B into the slot and then scaling it there gives the bits of scaling
    in float32 and rounding once. Same dtype: when every scaling is exact in it (the product
    is computed in float32 and rounded once). A cast into bfloat16: when every scaling is a
    power of two (alpha / r usually is), which commutes with rounding because bfloat16 has
    float32's exponent range (values below 2^-125 aside, where the two differ by a unit of
    ~1e-38). Not into float16, whose subnormals start at 6e-5."""
    if all(d.dtype == s.dtype for d, s in zip(dst, src)):
        return all(torch.tensor(x, dtype=t).item() == x for t, x in {(d.dtype, x) for d, x in zip(dst, scales)})
    return (all(d.dtype == torch.bfloat16 for d in dst)
            and all(x > 0 and math.frexp(x)[0] == 0.5 for x in set(scales)))


def attach_lora(model: torch.nn.Module, max_loras: int, max_rank: int) -> LoRAModel:
    """Give every ColumnParallelLinear / RowParallelLinear of `model` a LoRALayer (its
    `lora`, which its forward calls) and map HF module names onto them."""
    context = LoRAContext()
    targets: dict[str, LoRATarget] = {}
    packed = getattr(model, "packed_modules", {})
    # Modules marked lora_exempt (an MoE block: router, experts, shared expert) take none.
    exempt = tuple(f"{name}." for name, m in model.named_modules() if getattr(m, "lora_exempt", False))
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or name.startswith(exempt):
            continue
        layer = LoRALayer(module, context, max_loras, max_rank)
        # A plain attribute, not a submodule: the adapter weights are not model parameters
        # (weight loading, updates, sleep and dummy init never see them).
        object.__setattr__(module, "lora", layer)
        prefix, _, last = name.rpartition(".")
        hf_names = [f"{prefix}.{h}" if prefix else h for h in packed[last]] if last in packed else [name]
        if isinstance(module, RowParallelLinear):
            s = module.inputs
            targets[name] = LoRATarget(layer, 0, s.full, module.weight.shape[0],
                                       s if s.size != s.full else None, None)
            continue
        for i, (hf, s) in enumerate(zip(hf_names, module.outputs, strict=True)):
            targets[hf] = LoRATarget(layer, i, module.weight.shape[1], s.full, None,
                                     s if s.size != s.full else None)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no layers LoRA can adapt")
    return LoRAModel(targets, context, max_loras, max_rank, exempt)
