"""The engine's LoRA adapter calls: load (in place: a new weight version), unload (refused
while requests use the adapter), list. The adapters themselves are LoRAManager's (lora.py,
imported only where LoRA is enabled); EngineCore (core.py) takes these methods as a mixin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlserve.engine.request import Request
from rlserve.engine.scheduler import Scheduler
from rlserve.errors import ConflictError
from rlserve.sampling_params import InvalidRequestError

if TYPE_CHECKING:
    from rlserve.engine.lora import LoRAManager, ReadAdapter


class EngineLoRA:
    # EngineCore's (core.py), read here.
    lora: LoRAManager | None
    scheduler: Scheduler
    held: list[Request]

    if TYPE_CHECKING:

        def new_weight_version(self, version: int | str | None, reset_prefix_cache: bool = True) -> int: ...

    def require_lora(self) -> LoRAManager:
        if self.lora is None:
            raise InvalidRequestError("lora_name: LoRA adapters need a server started with --enable-lora", "lora_name")
        return self.lora

    def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> dict:
        """Load a PEFT adapter directory as `name`. In place (load_inplace), the requests
        running with it continue on the new weights, which is a new weight version."""
        return self.install_lora_adapter(self.require_lora().read(name, path, load_inplace))

    def install_lora_adapter(self, read: ReadAdapter) -> dict:
        """An adapter read off the engine thread (LoRAManager.read), put in place now."""
        adapter, replaced = self.require_lora().install(read)
        if replaced:
            self.new_weight_version(None)
        return adapter.info()

    def unload_lora_adapter(self, name: str) -> None:
        """Refused (ConflictError) while requests use the adapter: its slot may be reused."""
        lora = self.require_lora()
        lora.resolve(name, "lora_name")
        users = sum(r.lora_name == name for r in (*self.scheduler.requests.values(), *self.held))
        if users:
            raise ConflictError(
                f"lora_name: {users} request(s) still run with {name!r}; let them "
                "finish (or /pause?mode=abort) before unloading it"
            )
        lora.unload(name)

    def list_lora_adapters(self) -> list[dict]:
        return [] if self.lora is None else self.lora.list()
