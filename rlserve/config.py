"""Engine configuration: small dataclasses, validated on construction. EngineConfig is the
one source of the engine's `rlserve serve` flags (flags.py makes them from its fields)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from rlserve import envs
from rlserve.flags import byte_size, flag, no_flag, positive_int
from rlserve.sampling_params import LOGPROBS_MODES, MAX_LOGPROBS

# The reasoning parsers the server has (rlserve/frontend/reasoning_parsers.py, whose table a test
# checks against this list): named here, below the server, so config imports nothing above it.
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")

if TYPE_CHECKING:
    import torch

# dtype names -> torch's. torch is imported where a dtype or device is resolved, not here:
# `rlserve serve --help` builds its flags from EngineConfig without loading it.
_DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}
# vLLM's --kv-cache-dtype names. fp8 caches keep a float32 scale per token and kv head
# (rlserve/ops/attention.py), where vLLM takes one scale per layer, 1.0 unless calibrated.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": "bfloat16", "fp8": "float8_e4m3fn",
                   "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
LOAD_FORMATS = ("auto", "dummy", "safetensors", "pt")
BLOCK_SIZES = (8, 16, 32, 64, 128)


class GrammarLimits(NamedTuple):
    """The bounds on a structured-output grammar (engine/structured_output.py enforces them)."""

    max_size: int = 1 << 20  # bytes of the spec, and of the grammar's EBNF text
    timeout_s: float = 30.0  # seconds one compile may take


def resolve_dtype(dtype: str | torch.dtype, device: str, config_dtype: Any = None) -> torch.dtype:
    """`auto`: float32 on CPU; on CUDA the checkpoint's half type, bfloat16 for float32 ones."""
    import torch
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if not device.startswith("cuda"):
            return torch.float32
        if isinstance(config_dtype, str):
            config_dtype = getattr(torch, _DTYPES[config_dtype]) if config_dtype in _DTYPES else None
        return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unsupported {dtype!r}; choose auto, float32, bfloat16 or float16")
    return getattr(torch, _DTYPES[dtype])


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: `auto` keeps the model's. EngineConfig has checked
    the name."""
    import torch
    name = KV_CACHE_DTYPES[kv_cache_dtype]
    return model_dtype if name is None else getattr(torch, name)


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class WeightTransferConfig:
    """`--weight-transfer-config '{"backend": "nccl"}'`."""

    backend: str = "nccl"  # nccl | gloo | ipc
    timeout_s: float = 120.0  # every collective gives up after this long
    # The largest trainer group init_info may name: the trainer keeps state per rank, and a
    # group of millions would only hold memory and time until its timeout.
    max_world_size: int = 1024

    @classmethod
    def parse(cls, value: str | dict | None) -> WeightTransferConfig | None:
        if value is None:
            return None
        data = json.loads(value) if isinstance(value, str) else dict(value)
        unknown = set(data) - {"backend", "timeout_s", "timeout", "max_world_size"}
        if unknown:
            raise ValueError(f"weight-transfer-config: unknown keys {sorted(unknown)}; "
                             "known: backend, timeout_s, max_world_size")
        if "timeout" in data:
            data["timeout_s"] = data.pop("timeout")
        cfg = cls(**data)
        if cfg.backend not in ("nccl", "gloo", "ipc"):
            raise ValueError(f"weight-transfer-config: backend must be nccl, gloo or ipc, "
                             f"got {cfg.backend!r}")
        if not cfg.timeout_s > 0:
            raise ValueError("weight-transfer-config: timeout_s must be > 0")
        if not (isinstance(cfg.max_world_size, int) and 2 <= cfg.max_world_size < 1 << 31):
            raise ValueError("weight-transfer-config: max_world_size must be an integer in 2..2^31-1")
        return cfg


# Values as a command line writes them (flags.py has the general ones).

def logprobs_count(value: str) -> int:
    n = int(value)
    if n < -1:
        raise ValueError(f"must be -1 (the whole vocabulary) or at least 0, got {n}")
    return n


def lora_module(value: str) -> tuple[str, str]:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ...}`."""
    if value.lstrip().startswith("{"):
        try:
            data = json.loads(value)
            return str(data["name"]), str(data["path"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f'not {{"name": ..., "path": ...}}: {value!r} ({e})') from None
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"not name=path: {value!r}")
    return name, path


def read_chat_template(value: str) -> str:
    """A Jinja chat template: the text of the file `value` names, or `value` itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:  # a path that does not exist, most likely
        raise ValueError(f"no such file {value!r}")
    return value


_MODEL, _CACHE, _RUN, _LORA = "model", "cache and scheduling", "execution", "LoRA adapters"


@dataclass
class EngineConfig:
    """What the engine runs and how. Each field with `flag(...)` metadata is the
    `rlserve serve` flag of the same name (`--max-model-len` for max_model_len), its help
    and default taken from here; the offline LLM takes the fields as keyword arguments."""

    model: str = field(metadata=no_flag("the positional MODEL"))
    tokenizer: str | None = field(default=None, metadata=flag(
        "tokenizer directory (default: MODEL)", group=_MODEL))
    device: str = field(default="auto", metadata=flag(
        "cpu, cuda, cuda:1 ... (auto: cuda if present)", group=_MODEL))
    dtype: str | torch.dtype = field(default="auto", metadata=flag(
        "weights and activations; auto: float32 on CPU, the checkpoint's half type on CUDA",
        choices=["auto", *_DTYPES], group=_MODEL))
    load_format: str = field(default="auto", metadata=flag(
        "dummy: random weights, for a trainer to overwrite", choices=LOAD_FORMATS, group=_MODEL))
    seed: int = field(default=0, metadata=flag("seed of the dummy weights and of torch's generator",
                                                group=_MODEL))
    max_model_len: int | None = field(default=None, metadata=flag(
        "prompt + output token limit (default: the model's)", type=positive_int, group=_MODEL))
    trust_remote_code: bool = field(default=False, metadata=flag(
        "run the Python code a model's config or tokenizer ships (transformers' "
        "trust_remote_code); the architecture must still be one rlserve implements", group=_MODEL))
    # Cache
    block_size: int = field(default=16, metadata=flag(
        "tokens per KV-cache block", choices=BLOCK_SIZES, group=_CACHE))
    kv_cache_dtype: str = field(default="auto", metadata=flag(
        "element type of the KV cache; auto: the model's. fp8 (e4m3, a scale per token and "
        "head) holds twice the tokens of bf16 and decodes faster, at 3 mantissa bits",
        choices=list(KV_CACHE_DTYPES), group=_CACHE))
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        "reuse the KV cache of shared prompt prefixes", group=_CACHE))
    gpu_memory_utilization: float = field(default=0.9, metadata=flag(
        "fraction of GPU memory for weights, activations and KV cache", group=_CACHE))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=flag(
        "explicit KV cache budget, e.g. 2G (overrides the utilization; CPU default 1 GiB)",
        type=byte_size, group=_CACHE))
    num_kv_blocks: int | None = field(default=None, metadata=no_flag(
        "overrides both budgets; tests use it to force preemption"))
    # Scheduler
    max_num_seqs: int = field(default=256, metadata=flag(
        "sequences in one batch at most", type=positive_int, group=_CACHE))
    max_num_batched_tokens: int = field(default=8192, metadata=flag(
        "tokens in one step at most (prefill chunks + decodes)", type=positive_int, group=_CACHE))
    # Execution
    enforce_eager: bool = field(default=False, metadata=flag("no CUDA graphs", group=_RUN))
    batch_invariant: bool = field(default=False, metadata=flag(
        "a request's tokens and logprobs are bitwise the same whatever shares its steps (batch "
        "size, chunking, prefix cache), and equal to rlserve.batch_invariant's trainer forward; "
        "costs throughput (docs/on-policy.md). VLLM_BATCH_INVARIANT=1 sets it too", group=_RUN))
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "devices one model is split over", type=positive_int, aliases=["-tp"], group=_RUN))
    # Data parallel (frontend/dp_client.py): replicas behind one front end.
    data_parallel_size: int = field(default=1, metadata=flag(
        "engine replicas behind the one endpoint, each of --tensor-parallel-size devices "
        "(replica i: GPUs i*TP..(i+1)*TP-1)", type=positive_int, aliases=["-dp"], group=_RUN))
    dp_retry_on_failure: bool = field(default=False, metadata=flag(
        "data parallel: when a replica dies, run its requests that have produced no token yet "
        "again on another replica (else they fail with 503)", group=_RUN))
    dp_max_restarts: int = field(default=3, metadata=flag(
        "data parallel: restart a replica that died at most N times; it serves again once it "
        "has copied the current weights from a healthy replica", metavar="N", group=_RUN))
    dp_engines: list[dict[str, str]] | None = field(default=None, metadata=no_flag(
        "replicas started elsewhere (rlserve.ray), as {\"input\": zmq address, \"output\": "
        "zmq address} each, instead of local processes; `rlserve serve` reads RLSERVE_DP_ENGINES"))
    served_model_name: str | None = field(default=None, metadata=flag(
        "name clients use in `model` (default: MODEL)", group="server"))
    chat_template: str | None = field(default=None, metadata=flag(
        "Jinja chat template, as a file path or inline (default: the tokenizer's)",
        type=read_chat_template, group="server"))
    reasoning_parser: str | None = field(default=None, metadata=flag(
        "split a thinking model's reasoning from its answer (<think>...</think>): chat messages "
        "get `reasoning`, LLM.chat outputs `reasoning` and `content`",
        choices=list(REASONING_PARSER_NAMES), group="server"))
    weight_transfer: WeightTransferConfig | None = field(default=None, metadata=flag(
        'enable live weight updates, e.g. \'{"backend": "nccl"}\' (backends: nccl, gloo, ipc)',
        name="--weight-transfer-config", metavar="JSON", type=str, group=_RUN))
    skip_tokenizer_init: bool = field(default=False, metadata=flag(
        "no tokenizer (as vLLM): prompts are token ids, outputs are token ids with empty text; "
        "chat, stop strings and structured outputs are refused", group=_MODEL))
    async_scheduling: bool | None = field(default=None, metadata=no_flag(
        "launch step N+1 before reading back step N's tokens (None: on CUDA with one "
        "tensor-parallel rank); the offline API and benchmarks compare both"))
    logprobs_mode: str = field(default="raw_logprobs", metadata=flag(
        "raw: of the model's logits (what RL importance ratios need); processed: of the logits "
        "sampled from (after bias, masks, penalties, temperature, top-k/p, min-p)",
        choices=LOGPROBS_MODES, group="sampling defaults and outputs"))
    max_logprobs: int = field(default=MAX_LOGPROBS, metadata=flag(
        "the most logprobs, top_logprobs or prompt_logprobs a request may ask for; -1: no limit "
        "(a request's -1 asks for the whole vocabulary, vocab_size x 8 bytes a token on the host)",
        type=logprobs_count, metavar="N", group="sampling defaults and outputs"))
    enable_return_routed_experts: bool = field(default=False, metadata=flag(
        "mixture-of-experts models: record the experts every token went to at every layer and "
        "return them (CompletionOutput.routed_experts; each choice's routed_experts), for "
        "routing replay in the trainer; a dense model starts with a warning",
        group="sampling defaults and outputs"))
    max_grammar_size: int = field(default=1 << 20, metadata=flag(
        "structured outputs: a spec (JSON schema, regex, grammar, choices), or the grammar "
        "made from it, larger than this is refused with 400", type=byte_size,
        group="sampling defaults and outputs"))
    grammar_compile_timeout_s: float = field(default=30.0, metadata=flag(
        "structured outputs: a grammar whose compile takes longer is refused with 400 (the "
        "compile is stopped; real schemas take well under a second)", metavar="SECONDS",
        group="sampling defaults and outputs"))
    hf_overrides: dict[str, Any] = field(default_factory=dict, metadata=no_flag(
        "HF config attributes replaced (the offline API and tests)"))
    # LoRA adapters (rlserve/engine/lora.py): slots and the largest rank are fixed at start.
    enable_lora: bool = field(default=False, metadata=flag(
        "serve LoRA adapters (PEFT format), chosen per request by `model`", group=_LORA))
    max_loras: int = field(default=1, metadata=flag(
        "adapters on the device at once, the most one batch uses (their slots are allocated at "
        "start)", type=positive_int, group=_LORA))
    max_cpu_loras: int | None = field(default=None, metadata=flag(
        "adapters kept in host memory, swapped into the --max-loras slots least recently used "
        "first (default: --max-loras)", type=positive_int, group=_LORA))
    max_lora_rank: int = field(default=16, metadata=flag(
        "the largest adapter rank served", type=positive_int, group=_LORA))
    lora_modules: dict[str, str] = field(default_factory=dict, metadata=flag(
        'adapters loaded at start: name=path, or JSON {"name": ..., "path": ...}',
        type=lora_module, nargs="+", metavar="NAME=PATH", group=_LORA))

    def __post_init__(self) -> None:
        if not self.batch_invariant:
            self.batch_invariant = envs.VLLM_BATCH_INVARIANT.get()
        if self.device == "auto":
            self.device = default_device()
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(f"reasoning_parser: unknown {self.reasoning_parser!r}; "
                             f"choose one of {', '.join(REASONING_PARSER_NAMES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: unknown {self.load_format!r}; "
                             f"choose one of {', '.join(LOAD_FORMATS)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size: must be one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: unsupported {self.kv_cache_dtype!r}; "
                             f"choose one of {', '.join(KV_CACHE_DTYPES)}")
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
        if self.max_grammar_size < 1 or not self.grammar_compile_timeout_s > 0:
            raise ValueError("max_grammar_size, grammar_compile_timeout_s: must be positive")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs: must be -1 (the whole vocabulary) or at least 0, "
                             f"got {self.max_logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: must be one of {', '.join(LOGPROBS_MODES)}, "
                             f"got {self.logprobs_mode!r}")
        self._check_lora()
        if isinstance(self.weight_transfer, (str, dict)):
            self.weight_transfer = WeightTransferConfig.parse(self.weight_transfer)
        if (self.weight_transfer is not None and self.weight_transfer.backend == "nccl"
                and not str(self.device).startswith("cuda")):
            # NCCL moves CUDA tensors only: the trainer's group would form, then fail.
            raise ValueError(f"weight-transfer-config: backend nccl needs a CUDA device, this "
                             f"server runs on {self.device} (use gloo)")
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
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be >= max_loras ({self.max_loras})")
        self.lora_modules = dict(self.lora_modules or {})
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules: adapters need enable_lora (--enable-lora)")
        for name in self.lora_modules:
            if not name or name == self.name:
                raise ValueError(f"lora_modules: adapter name {name!r} must be non-empty and differ "
                                 "from the served model's name")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def grammar_limits(self) -> GrammarLimits:
        """How large a grammar, and how long its compile."""
        return GrammarLimits(self.max_grammar_size, self.grammar_compile_timeout_s)

    @property
    def state_cache_slots(self) -> int:
        """A hybrid model's prefix cache: the linear-attention states it keeps at block
        boundaries, as many as running sequences (0: prefix caching off)."""
        return self.max_num_seqs if self.enable_prefix_caching else 0

    def replica(self, index: int) -> EngineConfig:
        """The configuration of data-parallel replica `index`: one replica, on its devices."""
        device = self.device
        if str(device).startswith("cuda"):
            import torch
            base = torch.device(device).index or 0
            device = f"cuda:{base + index * self.tensor_parallel_size}"
        return dataclasses.replace(self, device=device, data_parallel_size=1, dp_engines=None)

    def to_wire(self) -> dict[str, Any]:
        """Plain data for another process (msgpack); `EngineConfig(**data)` rebuilds it."""
        data = dataclasses.asdict(self)
        if not isinstance(self.dtype, str):  # a torch.dtype
            data["dtype"] = str(self.dtype).removeprefix("torch.")
        return data
