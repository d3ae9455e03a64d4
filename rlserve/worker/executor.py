"""Runs calls on every worker. One in-process worker now; the tensor-parallel executor
starts one process per rank behind the same interface."""

from __future__ import annotations

from typing import Any

from rlserve.config import EngineConfig
from rlserve.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig, hf_config, model_path: str):
        self.worker = Worker(config, hf_config, model_path, rank=0)
        self.world_size = 1

    @property
    def driver(self) -> Worker:
        return self.worker

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker; returns the results in rank order."""
        return [getattr(self.worker, method)(*args, **kwargs)]

    def execute_model(self, sched, block_tables):
        return self.worker.execute_model(sched, block_tables)

    def shutdown(self) -> None:
        pass
