"""What every architecture shares: the HF-name -> fused-parameter mapping used both by
checkpoint loading and by live weight updates.

Fused parameters (qkv_proj, gate_up_proj) hold several HF tensors stacked along dim 0.
A model lists them in `packed_modules`: fused module name -> [(hf module name, rows)].
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
from torch import nn


class WeightSlot(NamedTuple):
    """Where one HF tensor goes: a parameter, and the rows of it (None: all of it)."""

    param: str
    start: int | None = None
    rows: int | None = None


class ExpectedWeight(NamedTuple):
    shape: tuple[int, ...]
    required: bool


class CausalLM(nn.Module):
    packed_modules: dict[str, list[tuple[str, int]]] = {}
    # HF names that may appear in checkpoints but carry nothing we use.
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    tie_word_embeddings: bool = False

    def _fused_lookup(self) -> dict[str, WeightSlot]:
        """hf name -> slot, for every name a checkpoint of this model may contain."""
        if getattr(self, "_slots", None) is not None:
            return self._slots
        slots: dict[str, WeightSlot] = {}
        for pname, _ in self.named_parameters():
            module, _, leaf = pname.rpartition(".")
            prefix, _, last = module.rpartition(".")
            if last in self.packed_modules:
                start = 0
                for hf_module, rows in self.packed_modules[last]:
                    slots[f"{prefix}.{hf_module}.{leaf}"] = WeightSlot(pname, start, rows)
                    start += rows
            else:
                slots[pname] = WeightSlot(pname)
        self._slots = slots
        return slots

    def expected_weights(self) -> dict[str, ExpectedWeight]:
        """Every HF tensor this model takes, with its shape; lm_head is optional when tied."""
        params = dict(self.named_parameters())
        out: dict[str, ExpectedWeight] = {}
        for name, slot in self._fused_lookup().items():
            shape = tuple(params[slot.param].shape)
            if slot.rows is not None:
                shape = (slot.rows, *shape[1:])
            out[name] = ExpectedWeight(shape, True)
        if self.tie_word_embeddings and "lm_head.weight" not in out:
            embed = next(n for n in out if n.endswith("embed_tokens.weight"))
            out["lm_head.weight"] = ExpectedWeight(out[embed].shape, False)
        return out

    def is_ignored_weight(self, name: str) -> bool:
        return name.endswith(self.ignored_suffixes) or (
            self.tie_word_embeddings and name == "lm_head.weight")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the existing parameter storage, in place.

        Returns the names loaded. Unknown names and wrong shapes raise, naming the tensor.
        """
        params = dict(self.named_parameters())
        slots = self._fused_lookup()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in slots and f"model.{name}" in slots:
                name = f"model.{name}"  # some checkpoints drop the base-model prefix
            if name not in slots:
                if self.is_ignored_weight(name):
                    continue
                raise KeyError(f"weight {name!r} is not a parameter of {type(self).__name__}")
            slot = slots[name]
            target = params[slot.param].data
            if slot.rows is not None:
                target = target.narrow(0, slot.start, slot.rows)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match "
                                 f"the model's {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
        return loaded

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
