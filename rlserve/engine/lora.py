"""The engine's LoRA adapters: which are loaded (by name), which of them sit in the device's
slots, and the calls that put them there on every tensor-parallel rank.

As in vLLM, `--max-loras` is the number of device slots and `--max-cpu-loras` the number of
adapters kept in host memory (each rank a copy of its shards, rlserve.model.lora). A
request whose adapter no slot holds takes, when it is scheduled, the least recently used
slot whose adapter no running request uses; when every slot is in use it waits. An
adapter that must make room in host memory is the least recently used one read from a
directory and used by no running request: it stays loaded (listed, served) and is read
again when a request needs it. An adapter a trainer pushed lives only in memory and is
never evicted; when only such adapters (or ones in use) fill host memory, a new one is
refused by name. The adapters' format (PEFT's config, tensor names, files) is
rlserve.model.peft.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, overload

from rlserve.errors import ModelNotFoundError
from rlserve.model.peft import LoRAConfig, pair_tensors, read_adapter
from rlserve.sampling_params import InvalidRequestError
from rlserve.worker import calls as rank

if TYPE_CHECKING:
    from rlserve.engine.request import Request
    from rlserve.weight_transfer.info import UpdateInfo
    from rlserve.worker.executor import Executor


class LoRARequest(NamedTuple):
    """vLLM's LoRARequest shape: which adapter a request uses. `lora_int_id` is accepted
    for compatibility and not used (adapters are known by name); with `lora_path` the
    adapter is loaded on first use."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


class ReadAdapter(NamedTuple):
    """An adapter directory as read (off the engine thread), waiting to be installed."""

    name: str
    path: str
    load_inplace: bool
    config: LoRAConfig
    tensors: list


@dataclass
class LoRAAdapter:
    name: str
    config: LoRAConfig
    path: str | None  # None: pushed by a trainer, so it lives only in memory
    generation: int  # changes with every load or update: the adapter's prefix-cache salt
    slot: int | None = None  # the device slot it sits in
    in_memory: bool = True  # False: evicted from host memory, read from `path` again on use
    host_stale: bool = False  # a push changed its slot since its host copy was written
    users: int = 0  # requests holding its slot (scheduled, or first in line for room)
    last_used: int = 0

    def cache_salt(self, salt: str | None) -> str:
        """Prefix-cache blocks are shared only among requests of the same adapter contents."""
        return f"\x00lora:{self.name}:{self.generation}\x00{salt or ''}"

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "slot": -1 if self.slot is None else self.slot,
            "path": self.path,
            "r": self.config.r,
            "lora_alpha": self.config.lora_alpha,
        }


def check_lora_name(name: Any, param: str = "lora_name") -> str:
    if not isinstance(name, str) or not name or len(name) > 256:
        raise InvalidRequestError(f"{param}: must be a non-empty string of at most 256 characters, got {name!r}", param)
    return name


class LoRAManager:
    """The engine's side of adapters: the table, the slots, host memory, and the calls that
    move adapters between them on every rank. Engine thread only."""

    def __init__(self, executor: Executor, max_loras: int, max_cpu_loras: int, max_rank: int) -> None:
        self.executor = executor
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: list[str | None] = [None] * max_loras  # the adapter in each slot
        self._generation = 0
        self._clock = 0  # uses, for least-recently-used choices

    @overload
    def resolve(self, name: str, param: str = ...) -> LoRAAdapter: ...
    @overload
    def resolve(self, name: None, param: str = ...) -> None: ...

    def resolve(self, name: str | None, param: str = "model") -> LoRAAdapter | None:
        """None for the base model; raises ModelNotFoundError (a 404, as vLLM answers) naming `param`."""
        if name is None:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(self.adapters) or "none"
            raise ModelNotFoundError(f"{param}: LoRA adapter {name!r} is not loaded (loaded: {known})", param)
        return adapter

    # -- loading and unloading ------------------------------------------------------------
    def load(self, name: str, path: str, load_inplace: bool = False) -> tuple[LoRAAdapter, bool]:
        """Read a PEFT directory into host memory (and a free slot, if any). Returns the
        adapter and whether it replaced one of the same name (whose requests now run on the
        new weights)."""
        return self.install(self.read(name, path, load_inplace))

    def _refuse_second_load(self, name: str, load_inplace: bool) -> None:
        if name in self.adapters and not load_inplace:  # vLLM's words for it
            raise InvalidRequestError(
                f"lora_name: the LoRA adapter {name!r} has already been loaded; "
                "unload it first, or pass load_inplace: true to replace it",
                "lora_name",
            )

    def read(self, name: str, path: str, load_inplace: bool = False) -> ReadAdapter:
        """The slow half of a load, safe off the engine thread (it reads files and checks
        them, and touches no table): the adapter as read, for `install`."""
        check_lora_name(name)
        self._refuse_second_load(name, load_inplace)
        config, tensors = read_adapter(path, self.max_rank)
        # Names, pairs and shapes, before anything moves (rank 0's model answers for all).
        lora = self.executor.lora
        assert lora is not None  # the manager exists where the model has LoRA slots
        try:
            lora.check(pair_tensors(tensors, config, "adapter_model", lora.exempt))
        except ValueError as e:
            raise InvalidRequestError(f"lora_path: {path}: {e}", "lora_path") from None
        return ReadAdapter(name, path, load_inplace, config, tensors)

    def install(self, read: ReadAdapter) -> tuple[LoRAAdapter, bool]:
        """The engine thread's half of a load: host memory, a slot, the table."""
        name, path, config, tensors = read.name, read.path, read.config, read.tensors
        self._refuse_second_load(name, read.load_inplace)  # loaded meanwhile
        old = self.adapters.get(name)
        self._make_room(name)
        slot = old.slot if old is not None and old.slot is not None else self._empty_slot()
        self.executor.load_tensors(rank.LoadLoRA(name, slot, config.to_wire()), tensors)
        adapter = self._put(name, config, path, slot)
        adapter.host_stale = False
        return adapter, old is not None

    def unload(self, name: str) -> LoRAAdapter:
        adapter = self.resolve(name, "lora_name")
        del self.adapters[name]
        if adapter.slot is not None:
            self.slots[adapter.slot] = None
        self.executor.collective_rpc(rank.RemoveLoRA(adapter.slot, name))
        return adapter

    def list(self) -> list[dict[str, Any]]:
        return [a.info() for a in self.adapters.values()]

    # -- live updates (engine/weight_updates.py) ------------------------------------------
    def update_config(self, update_info: UpdateInfo) -> dict[str, Any]:
        """An adapter update's config for the workers: the one it brings, else the loaded
        adapter's. Refuses what cannot be applied before any byte moves."""
        name = check_lora_name(update_info.lora_name, "update_info.lora_name")
        data = update_info.lora_config
        if data is None:
            if name not in self.adapters:
                raise InvalidRequestError(
                    f"update_info.lora_config: required for {name!r}, which is not loaded "
                    "(PEFT's adapter_config: r, lora_alpha, target_modules, ...)",
                    "update_info",
                )
            return self.adapters[name].config.to_wire()
        config = LoRAConfig.parse(data, "update_info.lora_config", self.max_rank)
        self._make_room(name, evict=False)
        return config.to_wire()

    def apply_update(self, name: str, config: Mapping[str, Any]) -> bool:
        """Copy a received adapter update into its slot, or its host copy when no slot holds
        it (between steps). Returns whether it replaced a loaded adapter."""
        adapter = self.adapters.get(name)
        try:
            self._make_room(name)  # filled meanwhile by loads from disk: refused
        except InvalidRequestError:
            self.executor.collective_rpc(rank.DropStaged())
            raise
        slot = adapter.slot if adapter is not None else self._empty_slot()
        self.executor.collective_rpc(rank.ApplyStaged(slot, name))
        # path None: its weights are the trainer's now, not a directory's
        updated = self._put(name, LoRAConfig.parse(config, "update_info.lora_config", self.max_rank), None, slot)
        updated.host_stale = slot is not None
        return adapter is not None

    # -- slots, as the scheduler admits requests -------------------------------------------
    def acquire(self, req: Request) -> bool:
        """Give a request being scheduled its adapter's slot (req.lora_slot), swapping the
        adapter in if no slot holds it; False when every slot is in use by other adapters'
        requests (it waits). Raises when the adapter cannot be brought back into memory."""
        assert req.lora_name is not None  # the scheduler asks for the requests with an adapter
        adapter = self.resolve(req.lora_name)
        self._clock += 1
        adapter.last_used = self._clock
        slot = adapter.slot
        if slot is None:
            slot = self._slot_to_take()
            if slot is None:
                return False
            self._swap_in(adapter, slot)
        adapter.users += 1
        req.lora_slot = slot
        return True

    def release(self, req: Request) -> None:
        """A request gives its slot back (finished, or preempted: it acquires one again)."""
        adapter = None if req.lora_name is None else self.adapters.get(req.lora_name)
        if adapter is not None:
            adapter.users -= 1
        req.lora_slot = -1

    def _slot_to_take(self) -> int | None:
        """An empty slot, else the least recently used one whose adapter nobody uses."""
        empty = self._empty_slot()
        if empty is not None:
            return empty
        idle = [self.adapters[n] for n in self.slots if n is not None and not self.adapters[n].users]
        return min(idle, key=lambda a: a.last_used).slot if idle else None

    def _swap_in(self, adapter: LoRAAdapter, slot: int) -> None:
        if not adapter.in_memory:
            self._make_room(adapter.name, param="model")  # may take the slot's adapter out of memory
        out = self.slots[slot]
        leaving = self.adapters[out] if out is not None else None
        save = out if leaving is not None and leaving.host_stale else None
        if leaving is not None:
            leaving.slot, leaving.host_stale = None, False
        self.slots[slot] = None
        if adapter.in_memory:
            self.executor.collective_rpc(rank.SwapLoRA(slot, save, adapter.name))
        else:  # evicted from host memory: read from its directory again
            if save is not None:
                self.executor.collective_rpc(rank.SwapLoRA(slot, save))
            assert adapter.path is not None  # only an adapter read from a directory is evicted
            try:
                config, tensors = read_adapter(adapter.path, self.max_rank)
            except InvalidRequestError as e:
                raise InvalidRequestError(
                    f"model: LoRA adapter {adapter.name!r} was evicted from host memory and cannot be read again: {e}",
                    "model",
                ) from None
            self.executor.load_tensors(rank.LoadLoRA(adapter.name, slot, config.to_wire()), tensors)
            adapter.in_memory = True
        adapter.slot, self.slots[slot] = slot, adapter.name

    # -- host memory -----------------------------------------------------------------------
    def _empty_slot(self) -> int | None:
        return next((i for i, n in enumerate(self.slots) if n is None), None)

    def _make_room(self, name: str, evict: bool = True, param: str = "lora_name") -> None:
        """Room in host memory for adapter `name` (nothing to do if it is there): evict the
        least recently used adapter read from a directory that no request uses, or refuse,
        naming `param`."""
        adapter = self.adapters.get(name)
        if adapter is not None and adapter.in_memory:
            return
        resident = [a for a in self.adapters.values() if a.in_memory]
        if len(resident) < self.max_cpu_loras:
            return
        evictable = [a for a in resident if a.path is not None and not a.users]
        if not evictable:
            raise InvalidRequestError(
                f"{param}: no room for LoRA adapter {name!r}: host memory holds --max-cpu-loras "
                f"{self.max_cpu_loras} adapters ({', '.join(a.name for a in resident)}), none of which "
                "can be evicted (an adapter pushed by a trainer exists only in memory; one whose "
                "requests run stays); unload one, or raise --max-cpu-loras",
                param,
            )
        if not evict:
            return
        victim = min(evictable, key=lambda a: a.last_used)
        self.executor.collective_rpc(rank.RemoveLoRA(victim.slot, victim.name))
        if victim.slot is not None:
            self.slots[victim.slot] = None
        victim.slot, victim.in_memory, victim.host_stale = None, False, False

    def _put(self, name: str, config: LoRAConfig, path: str | None, slot: int | None) -> LoRAAdapter:
        """The adapter `name` now has these contents (a new generation), in memory and in
        `slot` if given; its users and recency carry over."""
        self._generation += 1
        self._clock += 1
        adapter = self.adapters.get(name)
        if adapter is None:
            adapter = self.adapters[name] = LoRAAdapter(name, config, path, self._generation)
        adapter.config, adapter.path, adapter.generation, adapter.in_memory = config, path, self._generation, True
        adapter.last_used = self._clock
        if slot is not None:
            adapter.slot, self.slots[slot] = slot, name
        return adapter
