"""What every architecture shares: the HF-name -> parameter mapping used both by
checkpoint loading and by live weight updates.

Fused parameters (qkv_proj, gate_up_proj) hold several HF tensors stacked along dim 0.
A model lists them in `packed_modules`: fused module name -> HF module names, in stacking
order. Under tensor parallelism a parameter holds only its rank's slice of each HF tensor
(see parallel.py); the mapping still takes full HF tensors and copies the slice.

A name may also stand for others (`WeightSlot.covers`): a stacked expert tensor for the
per-expert tensors it holds, a second spelling of a checkpoint name. Such names are never
required themselves; the names they cover count as sent (`missing_weights`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from rlserve.model.parallel import ParallelLMHead, ShardedModule


@dataclass(frozen=True)
class ExpectedParam:
    """What the server's model accepts under one name: what a checkpoint load and a live
    update are both checked against (expected_weights() builds them from the weight slots)."""

    shape: tuple[int, ...]
    required: bool = True  # a required name missing from an update refuses it
    dtype: torch.dtype | None = None  # staging dtype for this name; None: receive_weights' target_dtype
    # Required names this one carries too (a stacked expert tensor's per-expert names): sent
    # with it, they are not missing, and sent beside it, they are sent twice.
    covers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))  # compared with metas' tuples

class ExpectedWeights(dict[str, ExpectedParam]):
    """A model's names and what each takes (name -> ExpectedParam), and the prefixes of
    names it takes and drops, whatever their shape: a multimodal trainer's vision tower,
    pushed with the text model whose server serves only the text."""

    def __init__(self, params=(), skipped_prefixes: tuple[str, ...] = ()):
        super().__init__(params)
        self.skipped_prefixes = skipped_prefixes

    def skips(self, name: str) -> bool:
        return bool(self.skipped_prefixes) and name.startswith(self.skipped_prefixes)


def skipped(names: Sequence[str], expected: Mapping[str, ExpectedParam]) -> int:
    """How many of `names` the model takes and drops."""
    if not isinstance(expected, ExpectedWeights) or not expected.skipped_prefixes:
        return 0
    return sum(map(expected.skips, names))


class Piece(NamedTuple):
    """source.narrow(dim, start, size) lands at target.narrow(dim, offset, size)."""

    dim: int
    start: int
    size: int
    offset: int


# A name's full shape and the (target view, the piece of the source it takes) pairs it copies.
CopyViews = tuple[tuple[int, ...], tuple[tuple[torch.Tensor, Piece | None], ...]]


def _pieces_are_whole(slot: WeightSlot, target: torch.Tensor) -> bool:
    """Whether the pieces tile the whole source onto the whole target at the same offsets
    (a stacked gate_up_proj without tensor parallelism)."""
    dims = {p.dim for p in slot.pieces}
    return (tuple(target.shape) == tuple(slot.full_shape) and len(dims) == 1
            and all(p.start == p.offset for p in slot.pieces)
            and sum(p.size for p in slot.pieces) == slot.full_shape[dims.pop()])


class WeightSlot(NamedTuple):
    """Where one HF tensor goes: into `param` (its row `expert` along dim 0, for a
    per-expert tensor), whole, or as `pieces` (a rank's slices of it)."""

    param: str
    full_shape: tuple[int, ...]  # the tensor as a checkpoint or a trainer holds it
    pieces: tuple[Piece, ...] = ()
    expert: int | None = None
    covers: tuple[str, ...] = ()  # the names this one stands for (see the module docstring)


class FullParameter(NamedTuple):
    """A parameter as a single-rank model holds it: its full shape, and the HF tensors
    stacked in it as (name, start, size) along `dim`."""

    param: str
    shape: tuple[int, ...]
    dim: int
    pieces: list[tuple[str, int, int]]


def missing_weights(expected: Mapping[str, ExpectedParam], sent: Iterable[str]) -> list[str]:
    """The required names neither sent nor covered by a name sent."""
    covered = set(sent)
    for name in list(covered):
        e = expected.get(name)
        if e is not None and e.covers:
            covered.update(e.covers)
    return [n for n, e in expected.items() if e.required and n not in covered]


# A tensor this large is copied on its own: one launch is hidden behind its bytes, and the
# plain copy runs at the copy floor where `_foreach_copy_` reached 70% of it (RESULTS.md).
SINGLE_COPY_BYTES = 32 << 20


@torch.no_grad()
def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """target.copy_(source) for each pair. On CUDA, the small ones in a few fused launches
    (one `_foreach_copy_` per dtype pair): an MoE update sent per expert is tens of
    thousands of tensors of a few MB, and one launch each would take longer than the bytes."""
    if not pairs or pairs[0][0].device.type != "cuda":
        for target, source in pairs:
            target.copy_(source)
        return
    groups: dict[tuple, tuple[list, list]] = {}
    for target, source in pairs:
        if target.nbytes >= SINGLE_COPY_BYTES:
            target.copy_(source)
            continue
        targets, sources = groups.setdefault((target.dtype, source.dtype, source.device), ([], []))
        targets.append(target)
        sources.append(source)
    for targets, sources in groups.values():
        torch._foreach_copy_(targets, sources)


class CausalLM(nn.Module):
    config: Any  # the model's transformers config, as its subclasses set it
    lm_head: ParallelLMHead
    packed_modules: dict[str, list[str]] = {}
    # HF names that may appear in checkpoints but carry nothing we use.
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    # Names taken and dropped, whatever their shape (a multimodal checkpoint's vision tower,
    # which a server of its text model does not hold); an update answers how many it dropped.
    skipped_prefixes: tuple[str, ...] = ()
    tie_word_embeddings: bool = False

    # (our infix, the checkpoint's): names that a checkpoint spells differently from the
    # trainer's named_parameters (Mixtral's block_sparse_moe); the checkpoint's is required.
    checkpoint_spellings: tuple[tuple[str, str], ...] = ()

    def _parameter_slots(self) -> Iterator[tuple[str, nn.Parameter, list[tuple[str, WeightSlot]]]]:
        """Every parameter once (a tied one under its first name), with the HF names it holds."""
        seen: set[int] = set()
        for mname, module in self.named_modules():
            own = dict(module.weight_slots(mname)) if hasattr(module, "weight_slots") else None
            for leaf, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                pname = f"{mname}.{leaf}" if mname else leaf
                slots = own[leaf] if own is not None else self._packed_slots(mname, module, leaf, param)
                yield pname, param, [(n, s._replace(param=pname)) for n, s in slots]

    def _packed_slots(self, mname: str, module: nn.Module, leaf: str, param: nn.Parameter
                      ) -> list[tuple[str, WeightSlot]]:
        """A (possibly fused, possibly sharded) parameter's HF tensors, stacked along its split dim."""
        prefix, _, last = mname.rpartition(".")
        hf_modules = self.packed_modules.get(last)
        pname = f"{mname}.{leaf}" if mname else leaf
        shards = module.weight_shards(leaf) if isinstance(module, ShardedModule) else [None]
        names = [f"{prefix}.{h}.{leaf}" for h in hf_modules] if hf_modules else [pname]
        if len(names) != len(shards):
            raise TypeError(f"{pname}: {len(names)} packed HF tensors but {len(shards)} shards")
        slots, offset = [], 0
        for name, shard in zip(names, shards):
            if shard is None:
                slots.append((name, WeightSlot(pname, tuple(param.shape))))
                continue
            full = list(param.shape)
            full[shard.dim] = shard.full
            slots.append((name, WeightSlot(pname, tuple(full), (Piece(shard.dim, shard.start, shard.size, offset),))))
            offset += shard.size
        return slots

    def _fused_lookup(self) -> dict[str, WeightSlot]:
        """hf name -> slot, for every name a checkpoint or a trainer of this model may send;
        built once, so a name resolves in O(1) however many experts the model has."""
        if getattr(self, "_slots", None) is None:
            lookup = {name: slot for _, _, slots in self._parameter_slots() for name, slot in slots}
            for ours, theirs in self.checkpoint_spellings:
                for name, slot in list(lookup.items()):
                    if ours in name and not slot.covers:
                        lookup[name.replace(ours, theirs)] = slot
                        lookup[name] = slot._replace(covers=(name.replace(ours, theirs),))
            self._slots = lookup
        return self._slots

    def expected_weights(self) -> ExpectedWeights:
        """Every HF tensor this model takes, at its full shape; lm_head is optional when tied.
        Names that stand for others (`covers`) are optional; the ones they cover required."""
        out = {name: ExpectedParam(slot.full_shape, not slot.covers, covers=slot.covers)
               for name, slot in self._fused_lookup().items()}
        if self.tie_word_embeddings and "lm_head.weight" not in out:
            embed = next(n for n in out if n.endswith("embed_tokens.weight"))
            out["lm_head.weight"] = ExpectedParam(out[embed].shape, False)
        return ExpectedWeights(out, self.skipped_prefixes)

    def full_parameters(self) -> list[FullParameter]:
        """The parameters as one unsharded rank holds them, in `named_parameters` order;
        lets every tensor-parallel size draw the same dummy weights. Each is tiled by the
        names that fill it whole (a stacked expert tensor, not its per-expert names)."""
        order = {name: i for i, (name, _) in enumerate(self.named_parameters())}
        result = []
        for pname, param, slots in self._parameter_slots():
            slots = [(n, s) for n, s in slots if s.expert is None]
            dim = next((s.pieces[0].dim for _, s in slots if s.pieces), 0)
            pieces, start = [], 0
            for name, slot in slots:
                pieces.append((name, start, slot.full_shape[dim]))
                start += slot.full_shape[dim]
            shape = list(param.shape)
            shape[dim] = start
            result.append(FullParameter(pname, tuple(shape), dim, pieces))
        return sorted(result, key=lambda p: order[p.param])

    def is_ignored_weight(self, name: str) -> bool:
        return name.endswith(self.ignored_suffixes) or (
            self.tie_word_embeddings and name == "lm_head.weight") or (
            bool(self.skipped_prefixes) and name.startswith(self.skipped_prefixes))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy full HF-named tensors into the existing parameter storage, in place; a
        tensor-parallel rank copies only its shard.

        Returns the names loaded. Unknown names and wrong shapes raise, naming the tensor;
        `missing_weights(self.expected_weights(), loaded)` says what a load left out.
        """
        loaded: set[str] = set()
        for name, target, source in self.weight_copies(weights):
            target.copy_(source)
            loaded.add(name)
        return loaded

    def copy_pairs(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(target, source) for tensors already checked against `expected_weights` (a live
        update's staging): one lookup a name and no shape checks, for the tens of thousands
        of names an MoE update may have; anything else goes through `weight_copies`."""
        table, pairs = self._copy_table(), []
        for name, tensor in weights:
            entry = table.get(name)
            if entry is None:
                pairs += [(target, source) for _, target, source in self.weight_copies(((name, tensor),))]
                continue
            for target, p in entry[1]:
                pairs.append((target, tensor if p is None else tensor.narrow(p.dim, p.start, p.size)))
        return pairs

    def weight_copies(self, weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, target, source) for each tensor: the copies `load_weights` makes, lazily,
        so a checkpoint streams. Targets are views of the current parameter storage."""
        table = self._copy_table()
        for name, tensor in weights:
            entry = table.get(name)
            if entry is None:
                entry = table.get(f"model.{name}")  # some checkpoints drop the base-model prefix
                if entry is None:
                    if self.is_ignored_weight(name):
                        continue
                    raise KeyError(f"weight {name!r} is not a parameter of {type(self).__name__}")
                name = f"model.{name}"
            shape, targets = entry
            if tensor.shape != shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match "
                                 f"the model's {shape}")
            for target, p in targets:
                yield name, target, tensor if p is None else tensor.narrow(p.dim, p.start, p.size)

    def _copy_table(self) -> dict[str, CopyViews]:
        """name -> (its full shape, [(target view, the piece of the source it takes, None: all
        of it)]), made once for the current parameter storage (sleep and wake replace it):
        resolving a name is then one dict lookup, however many thousand expert tensors an
        update has."""
        params = dict(self.named_parameters())
        key = tuple(p.data_ptr() for p in params.values())
        cached = getattr(self, "_views", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        table: dict[str, CopyViews] = {}
        for name, slot in self._fused_lookup().items():
            target = params[slot.param].data
            if slot.expert is not None:
                target = target[slot.expert]
            if not slot.pieces or _pieces_are_whole(slot, target):
                table[name] = (slot.full_shape, ((target, None),))  # one contiguous copy, not one per piece
                continue
            table[name] = (slot.full_shape, tuple(
                (target.narrow(p.dim, p.offset, p.size),
                 None if p.start == 0 and p.size == slot.full_shape[p.dim] else p) for p in slot.pieces))
        self._views = (key, table)
        return table

    def activation_width(self) -> int:
        """Elements per token of the widest activations a step holds (the KV cache is
        sized to leave room for them)."""
        hf = self.config
        return max(hf.hidden_size * 4, getattr(hf, "intermediate_size", 0) * 2)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
