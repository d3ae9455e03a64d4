"""Engine configuration: small dataclasses, validated on construction."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from rlserve.sampling_params import LOGPROBS_MODES

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
LOAD_FORMATS = ("auto", "dummy", "safetensors", "pt")


def resolve_dtype(dtype: str | torch.dtype, device: str, config_dtype: Any = None) -> torch.dtype:
    """`auto`: float32 on CPU; on CUDA the checkpoint's half type, bfloat16 for float32 ones."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if not device.startswith("cuda"):
            return torch.float32
        if isinstance(config_dtype, str):
            config_dtype = _DTYPES.get(config_dtype)
        return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unsupported {dtype!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class WeightTransferConfig:
    """`--weight-transfer-config '{"backend": "nccl"}'`."""

    backend: str = "nccl"  # nccl | gloo | ipc
    timeout_s: float = 120.0  # every collective gives up after this long

    @classmethod
    def parse(cls, value: str | dict | None) -> "WeightTransferConfig | None":
        if value is None:
            return None
        data = json.loads(value) if isinstance(value, str) else dict(value)
        unknown = set(data) - {"backend", "timeout_s", "timeout"}
        if unknown:
            raise ValueError(f"weight-transfer-config: unknown keys {sorted(unknown)}; "
                             "known: backend, timeout_s")
        if "timeout" in data:
            data["timeout_s"] = data.pop("timeout")
        cfg = cls(**data)
        if cfg.backend not in ("nccl", "gloo", "ipc"):
            raise ValueError(f"weight-transfer-config: backend must be nccl, gloo or ipc, "
                             f"got {cfg.backend!r}")
        if not cfg.timeout_s > 0:
            raise ValueError("weight-transfer-config: timeout_s must be > 0")
        return cfg


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str | torch.dtype = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # Cache
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # explicit budget; CPU default 1 GiB
    num_kv_blocks: int | None = None  # overrides both budgets (tests use it to force preemption)
    # Scheduler
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Execution
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    # Data parallel (engine/dp_client.py): replicas behind one front end; replica i runs on
    # devices [i*TP, (i+1)*TP) on GPU. A dead replica's requests that have produced nothing
    # yet are retried once on another (else they fail); it is restarted up to
    # dp_max_restarts times. dp_engines: replicas started elsewhere (rlserve.ray), as
    # {"input": zmq address, "output": zmq address} each, instead of local processes.
    data_parallel_size: int = 1
    dp_retry_on_failure: bool = False
    dp_max_restarts: int = 3
    dp_engines: list[dict[str, str]] | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    weight_transfer: WeightTransferConfig | None = None
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False
    # Launch step N+1 before reading back step N's tokens (None: on CUDA only).
    async_scheduling: bool | None = None
    logprobs_mode: str = "raw_logprobs"  # see LOGPROBS_MODES
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # LoRA adapters (rlserve/engine/lora.py): slots and the largest rank are fixed at start.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> PEFT directory, loaded at start

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = default_device()
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: unknown {self.load_format!r}; "
                             f"choose one of {', '.join(LOAD_FORMATS)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("block_size: must be one of 8, 16, 32, 64, 128")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs: must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size: must be at least 1")
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size: must be at least 1")
        if self.data_parallel_size > 1 and self.enable_lora:
            # The router does not yet carry adapter names and adapter loads to every replica.
            raise ValueError("enable_lora: not supported with data_parallel_size > 1 yet; "
                             "run one server per replica")
        if self.dp_engines is not None and len(self.dp_engines) != self.data_parallel_size:
            raise ValueError(f"dp_engines: {len(self.dp_engines)} given for data_parallel_size "
                             f"{self.data_parallel_size}")
        if self.dp_max_restarts < 0:
            raise ValueError("dp_max_restarts: must be at least 0")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: must be one of {', '.join(LOGPROBS_MODES)}, "
                             f"got {self.logprobs_mode!r}")
        self._check_lora()
        if isinstance(self.weight_transfer, (str, dict)):
            self.weight_transfer = WeightTransferConfig.parse(self.weight_transfer)
        if self.weight_transfer is not None and self.weight_transfer.backend == "ipc":
            # Handles open only on the GPU that holds the trainer's memory.
            if not str(self.device).startswith("cuda"):
                raise ValueError(f"weight-transfer-config: backend ipc needs a CUDA device, "
                                 f"this server runs on {self.device} (use gloo)")
            if self.tensor_parallel_size != 1 or self.data_parallel_size != 1:
                raise ValueError("weight-transfer-config: backend ipc needs tensor_parallel_size 1 "
                                 "and data_parallel_size 1 "
                                 "(each rank would need the trainer on its own GPU; use nccl)")

    def _check_lora(self) -> None:
        if not isinstance(self.max_loras, int) or not 1 <= self.max_loras <= 256:
            raise ValueError(f"max_loras: must be an integer in 1..256, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank: must be an integer in 1..512, got {self.max_lora_rank!r}")
        self.lora_modules = dict(self.lora_modules or {})
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules: adapters need enable_lora (--enable-lora)")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"lora_modules: {len(self.lora_modules)} adapters, but max_loras is "
                             f"{self.max_loras} (raise --max-loras)")
        for name in self.lora_modules:
            if not name or name == self.name:
                raise ValueError(f"lora_modules: adapter name {name!r} must be non-empty and differ "
                                 "from the served model's name")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def replica(self, index: int) -> "EngineConfig":
        """The configuration of data-parallel replica `index`: one replica, on its devices."""
        device = self.device
        if str(device).startswith("cuda"):
            base = torch.device(device).index or 0
            device = f"cuda:{base + index * self.tensor_parallel_size}"
        return dataclasses.replace(self, device=device, data_parallel_size=1, dp_engines=None)

    def to_wire(self) -> dict[str, Any]:
        """Plain data for another process (msgpack); `EngineConfig(**data)` rebuilds it."""
        data = dataclasses.asdict(self)
        if isinstance(self.dtype, torch.dtype):
            data["dtype"] = str(self.dtype).removeprefix("torch.")
        return data
