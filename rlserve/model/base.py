"""What every architecture shares: the HF-name -> parameter mapping used both by
checkpoint loading and by live weight updates.

Fused parameters (qkv_proj, gate_up_proj) hold several HF tensors stacked along dim 0.
A model lists them in `packed_modules`: fused module name -> HF module names, in stacking
order. Under tensor parallelism a parameter holds only its rank's slice of each HF tensor
(see parallel.py); the mapping still takes full HF tensors and copies the slice.
"""

from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple

import torch
from torch import nn

from rlserve.model.parallel import Shard, ShardedModule


class WeightSlot(NamedTuple):
    """Where one HF tensor goes: into `param`, whole, or (with `shard`) its slice
    shard.start..+shard.size along shard.dim lands at `offset` along the same dim."""

    param: str
    full_shape: tuple[int, ...]  # the tensor as a checkpoint or a trainer holds it
    shard: Shard | None = None
    offset: int = 0


class ExpectedWeight(NamedTuple):
    shape: tuple[int, ...]
    required: bool


class FullParameter(NamedTuple):
    """A parameter as a single-rank model holds it: its full shape, and the HF tensors
    stacked in it as (name, start, size) along `dim`."""

    param: str
    shape: tuple[int, ...]
    dim: int
    pieces: list[tuple[str, int, int]]


class CausalLM(nn.Module):
    packed_modules: dict[str, list[str]] = {}
    # HF names that may appear in checkpoints but carry nothing we use.
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    tie_word_embeddings: bool = False

    def _parameter_slots(self) -> Iterator[tuple[str, nn.Parameter, list[tuple[str, WeightSlot]]]]:
        """Every parameter once (a tied one under its first name), with the HF names it holds."""
        seen: set[int] = set()
        for mname, module in self.named_modules():
            prefix, _, last = mname.rpartition(".")
            hf_modules = self.packed_modules.get(last)
            for leaf, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
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
                    slots.append((name, WeightSlot(pname, tuple(full), shard, offset)))
                    offset += shard.size
                yield pname, param, slots

    def _fused_lookup(self) -> dict[str, WeightSlot]:
        """hf name -> slot, for every name a checkpoint of this model may contain."""
        if getattr(self, "_slots", None) is None:
            self._slots = {name: slot for _, _, slots in self._parameter_slots() for name, slot in slots}
        return self._slots

    def expected_weights(self) -> dict[str, ExpectedWeight]:
        """Every HF tensor this model takes, at its full shape; lm_head is optional when tied."""
        out = {name: ExpectedWeight(slot.full_shape, True) for name, slot in self._fused_lookup().items()}
        if self.tie_word_embeddings and "lm_head.weight" not in out:
            embed = next(n for n in out if n.endswith("embed_tokens.weight"))
            out["lm_head.weight"] = ExpectedWeight(out[embed].shape, False)
        return out

    def full_parameters(self) -> list[FullParameter]:
        """The parameters as one unsharded rank holds them, in `named_parameters` order;
        lets every tensor-parallel size draw the same dummy weights."""
        order = {name: i for i, (name, _) in enumerate(self.named_parameters())}
        result = []
        for pname, param, slots in self._parameter_slots():
            dim = next((s.shard.dim for _, s in slots if s.shard is not None), 0)
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
            self.tie_word_embeddings and name == "lm_head.weight")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy full HF-named tensors into the existing parameter storage, in place; a
        tensor-parallel rank copies only its shard.

        Returns the names loaded. Unknown names and wrong shapes raise, naming the tensor.
        """
        loaded: set[str] = set()
        for name, target, source in self.weight_copies(weights):
            target.copy_(source)
            loaded.add(name)
        return loaded

    def weight_copies(self, weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, target, source) for each tensor: the copies `load_weights` makes, lazily,
        so a checkpoint streams. Targets are views of the current parameter storage."""
        params = dict(self.named_parameters())
        slots = self._fused_lookup()
        for name, tensor in weights:
            if name not in slots and f"model.{name}" in slots:
                name = f"model.{name}"  # some checkpoints drop the base-model prefix
            if name not in slots:
                if self.is_ignored_weight(name):
                    continue
                raise KeyError(f"weight {name!r} is not a parameter of {type(self).__name__}")
            slot = slots[name]
            if tuple(tensor.shape) != slot.full_shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match "
                                 f"the model's {slot.full_shape}")
            target = params[slot.param].data
            if slot.shard is not None:
                s = slot.shard
                tensor = tensor.narrow(s.dim, s.start, s.size)
                target = target.narrow(s.dim, slot.offset, s.size)
            yield name, target, tensor

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
