"""The engine's LoRA adapters: its table of loaded adapters (name -> slot), and the calls
that load, update and remove them on every tensor-parallel rank. The adapters' format
(PEFT's config, tensor names, files) is rlserve.model.peft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from rlserve.model.peft import LoRAConfig, pair_tensors, read_adapter
from rlserve.sampling_params import InvalidRequestError
from rlserve.worker import calls as rank


class LoRARequest(NamedTuple):
    """vLLM's LoRARequest shape: which adapter a request uses. `lora_int_id` is accepted
    for compatibility and not used (adapters are known by name); with `lora_path` the
    adapter is loaded on first use."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


@dataclass
class LoRAAdapter:
    name: str
    slot: int
    config: LoRAConfig
    path: str | None  # None: pushed by a trainer
    generation: int  # changes with every load or update: the adapter's prefix-cache salt

    def cache_salt(self, salt: str | None) -> str:
        """Prefix-cache blocks are shared only among requests of the same adapter contents."""
        return f"\x00lora:{self.name}:{self.generation}\x00{salt or ''}"

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "slot": self.slot, "path": self.path, "r": self.config.r,
                "lora_alpha": self.config.lora_alpha}


class LoRARegistry:
    """The engine's loaded adapters (engine thread only)."""

    def __init__(self, max_loras: int, max_rank: int):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self._generation = 0

    def get(self, name: str, param: str = "model") -> LoRAAdapter:
        """Raises ModelNotFoundError (a 404, as vLLM answers) naming `param`."""
        adapter = self.adapters.get(name)
        if adapter is None:
            from rlserve.engine.messages import ModelNotFoundError
            known = ", ".join(sorted(self.adapters)) or "none"
            raise ModelNotFoundError(f"{param}: LoRA adapter {name!r} is not loaded (loaded: {known})", param)
        return adapter

    def free_slot(self, name: str) -> int:
        """`name`'s slot if loaded, else a free one; refuses when every slot is taken."""
        if name in self.adapters:
            return self.adapters[name].slot
        used = {a.slot for a in self.adapters.values()}
        free = [s for s in range(self.max_loras) if s not in used]
        if not free:
            raise InvalidRequestError(
                f"lora_name: {self.max_loras} adapters are loaded, max_loras is {self.max_loras}; unload "
                f"one first ({', '.join(sorted(self.adapters))})", "lora_name")
        return free[0]

    def put(self, name: str, slot: int, config: LoRAConfig, path: str | None) -> LoRAAdapter:
        self._generation += 1
        adapter = self.adapters[name] = LoRAAdapter(name, slot, config, path, self._generation)
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        adapter = self.get(name, "lora_name")
        del self.adapters[name]
        return adapter


def check_lora_name(name: Any, param: str = "lora_name") -> str:
    if not isinstance(name, str) or not name or len(name) > 256:
        raise InvalidRequestError(f"{param}: must be a non-empty string of at most 256 characters, "
                                  f"got {name!r}", param)
    return name


class LoRAManager:
    """The engine's side of adapters: the registry, and the calls that put adapters into
    (or take them out of) every tensor-parallel rank's slots. Engine thread only."""

    def __init__(self, executor, max_loras: int, max_rank: int):
        self.executor = executor
        self.registry = LoRARegistry(max_loras, max_rank)

    def resolve(self, name: str | None, param: str = "model") -> LoRAAdapter | None:
        return None if name is None else self.registry.get(name, param)

    def load(self, name: str, path: str, load_inplace: bool = False) -> tuple[LoRAAdapter, bool]:
        """Read a PEFT directory and put it in a slot. Returns the adapter and whether it
        replaced one of the same name (whose requests now run on the new weights)."""
        check_lora_name(name)
        replaced = name in self.registry.adapters
        if replaced and not load_inplace:
            raise InvalidRequestError(f"lora_name: an adapter named {name!r} is already loaded "
                                      "(unload it first, or pass load_inplace)", "lora_name")
        config, tensors = read_adapter(path, self.registry.max_rank)
        # Names and pairs, before any rank is called (rank 0's model says what takes none).
        pair_tensors(tensors, config, "adapter_model", self.executor.driver.lora.exempt)
        slot = self.registry.free_slot(name)
        try:
            self.executor.load_tensors(rank.LoadLoRA(slot, config.to_wire()), tensors)
        except ValueError as e:  # what the model refuses (unknown modules, shapes): nothing written
            raise InvalidRequestError(f"lora_path: {path}: {e}", "lora_path") from None
        return self.registry.put(name, slot, config, path), replaced

    def unload(self, name: str) -> LoRAAdapter:
        adapter = self.registry.remove(name)
        self.executor.collective_rpc(rank.RemoveLoRA(adapter.slot, name))
        return adapter

    def update_config(self, update_info: Mapping[str, Any]) -> dict[str, Any]:
        """An adapter update's config for the workers: the one it brings, else the loaded
        adapter's. Refuses what cannot be applied before any byte moves."""
        name = check_lora_name(update_info.get("lora_name"), "update_info.lora_name")
        data = update_info.get("lora_config")
        if data is None:
            if name not in self.registry.adapters:
                raise InvalidRequestError(
                    f"update_info.lora_config: required for {name!r}, which is not loaded "
                    "(PEFT's adapter_config: r, lora_alpha, target_modules, ...)", "update_info")
            return self.registry.adapters[name].config.to_wire()
        config = LoRAConfig.parse(data, "update_info.lora_config", self.registry.max_rank)
        self.registry.free_slot(name)  # room for it, unless already loaded
        return config.to_wire()

    def apply_update(self, name: str, config: Mapping[str, Any]) -> bool:
        """Copy a received adapter update into its slot (between steps). Returns whether
        it replaced a loaded adapter."""
        replaced = name in self.registry.adapters
        try:
            slot = self.registry.free_slot(name)  # taken meanwhile by a load from disk: refused
        except InvalidRequestError:
            self.executor.collective_rpc(rank.DropStaged())
            raise
        self.executor.collective_rpc(rank.ApplyStaged(slot))
        # path None: its weights are the trainer's now, not a directory's
        self.registry.put(name, slot, LoRAConfig.parse(config, "update_info.lora_config", self.registry.max_rank),
                          None)
        return replaced

    def list(self) -> list[dict[str, Any]]:
        return [a.info() for a in sorted(self.registry.adapters.values(), key=lambda a: a.slot)]
