"""The trainer's `init_info` and `update_info`, parsed once into typed values.

The API server parses each payload as it arrives (a refusal is a 400 naming the field and
the limit) and sends the typed value on: to the engine inside its control message, to
every rank inside the rank's call (msgpack, decoded back into these structs). A rank
checks an update against what it holds (the model's names, its group, its IPC documents)
and never parses the JSON again.

Torch-free: the API server imports this (through rlserve.wire.messages), and never loads
torch for it.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .address import address_problem
from .errors import InvalidUpdateError

# The dtype names a trainer writes (str(dtype).split(".")[-1]); packing.DTYPES maps them to torch's.
DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
)
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 512 << 20  # large enough to saturate NVLink, small next to a model
DEFAULT_PACKED_NUM_BUFFERS = 2  # pack/unpack bucket i+1 while bucket i is on the wire
MAX_NUM_BUFFERS = 8
MAX_WORLD_SIZE = (1 << 31) - 1  # NCCL's and torch.distributed's rank count is a 32-bit int
MAX_DIM = (1 << 63) - 1  # a tensor dimension is an int64 everywhere it goes
MAX_RANK = 64  # torch's limit on a tensor's dimensions
_LIST_CAP = 10
_KNOWN_DTYPES = frozenset(DTYPE_NAMES)
_TENSOR_LISTS = ("names", "dtype_names", "shapes")


def listing(items: Sequence[str]) -> str:
    """At most _LIST_CAP items, then how many more: messages stay readable for big models."""
    shown = ", ".join(items[:_LIST_CAP])
    return shown + (f" (and {len(items) - _LIST_CAP} more)" if len(items) > _LIST_CAP else "")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _field_problems(data: Mapping[str, Any], required: Sequence[str], known: Sequence[str], missing: str) -> list[str]:
    """The required fields `data` lacks (each worded as `missing`), then those it has that
    are not `known`."""
    problems = [missing.format(k) for k in required if k not in data]
    unknown = sorted(set(data) - set(known))
    if unknown:
        problems.append(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return problems


class InitInfo(msgspec.Struct, frozen=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int

    @classmethod
    def parse(cls, data: Mapping[str, Any], num_workers: int = 1, max_world_size: int = MAX_WORLD_SIZE) -> InitInfo:
        """Validate the trainer's init_info for a server with `num_workers` receiving ranks, in
        a group of at most `max_world_size` (the server's weight-transfer-config)."""
        if not isinstance(data, Mapping):
            raise InvalidUpdateError("init_info must be a JSON object")
        fields = ("master_address", "master_port", "rank_offset", "world_size")
        problems = _field_problems(data, fields, fields, "missing {}")
        if problems:
            raise InvalidUpdateError("init_info: " + "; ".join(problems))
        addr, port, offset, world = (data[k] for k in fields)
        bad_address = address_problem(addr)
        if bad_address:
            problems.append(f"master_address {bad_address}")
        if not (_is_int(port) and 0 < port < 65536):
            problems.append(f"master_port must be an integer in 1..65535, got {port!r}")
        if not (_is_int(offset) and offset >= 1):
            problems.append(f"rank_offset must be an integer >= 1 (rank 0 is the trainer), got {offset!r}")
        if not (_is_int(world) and world <= max_world_size):
            limit = "" if max_world_size == MAX_WORLD_SIZE else " (weight-transfer-config max_world_size)"
            problems.append(f"world_size must be an integer up to {max_world_size}{limit}, got {world!r:.40}")
        elif _is_int(offset) and offset + num_workers > world:
            problems.append(
                f"world_size {world} is too small: this server has {num_workers} worker(s) "
                f"at ranks {offset}..{offset + num_workers - 1}"
            )
        if problems:
            raise InvalidUpdateError("init_info: " + "; ".join(problems))
        return cls(addr, port, offset, world)


class UpdateInfo(msgspec.Struct, frozen=True):
    names: tuple[str, ...]
    dtype_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    weight_version: int | str | None = None
    ipc_handles: Any = None  # the ipc backend's handles, validated by ipc.IPCHandles.parse
    # A LoRA update: the tensors are this adapter's PEFT weights (rlserve.model.peft);
    # lora_config (PEFT's adapter_config fields) is required for an adapter not yet loaded.
    lora_name: str | None = None
    lora_config: dict[str, Any] | None = None

    @classmethod
    def parse(cls, data: Mapping[str, Any], references: bool = False) -> UpdateInfo:
        """Validate the trainer's update_info JSON; every problem found is reported at once.
        With `references` (the ipc backend), `ipc_handles: {"same_as": id}` stands for the
        last document the server accepted, in place of the tensor lists."""
        if not isinstance(data, Mapping):
            raise InvalidUpdateError("update_info must be a JSON object")
        if references and is_reference(data):
            return cls._reference(data)
        known = (
            "names",
            "dtype_names",
            "shapes",
            "packed",
            "packed_buffer_size_bytes",
            "packed_num_buffers",
            "weight_version",
            "ipc_handles",
            "lora_name",
            "lora_config",
        )
        problems = _field_problems(data, _TENSOR_LISTS, known, "{} is required")
        if problems:
            raise InvalidUpdateError("update_info: " + "; ".join(problems))

        names, dtypes, shapes = data["names"], data["dtype_names"], data["shapes"]
        for key, value in (("names", names), ("dtype_names", dtypes), ("shapes", shapes)):
            if not isinstance(value, list):
                problems.append(f"{key} must be a list, got {type(value).__name__}")
        if problems:
            raise InvalidUpdateError("update_info: " + "; ".join(problems))
        if not len(names) == len(dtypes) == len(shapes):
            raise InvalidUpdateError(
                f"update_info: names, dtype_names and shapes must have the same length, "
                f"got {len(names)}, {len(dtypes)} and {len(shapes)}"
            )
        problems += _tensor_list_problems(names, dtypes, shapes)
        return cls._with_options(data, problems, tuple(names), tuple(dtypes), tuple(map(tuple, shapes)))

    @classmethod
    def _reference(cls, data: Mapping[str, Any]) -> UpdateInfo:
        """`ipc_handles: {"same_as": id}`: the receiver finds the document it names."""
        handles = data["ipc_handles"]
        if len(handles) != 1:
            raise InvalidUpdateError(f"update_info.ipc_handles: same_as comes alone (got {', '.join(sorted(handles))})")
        extra = [k for k in _TENSOR_LISTS if k in data]
        if extra:
            raise InvalidUpdateError(
                f"update_info: {', '.join(extra)} and ipc_handles.same_as exclude each "
                "other (a reference repeats the document it names)"
            )
        return cls._with_options(data, [], (), (), ())

    @classmethod
    def _with_options(
        cls,
        data: Mapping[str, Any],
        problems: list[str],
        names: tuple[str, ...],
        dtypes: tuple[str, ...],
        shapes: tuple[tuple[int, ...], ...],
    ) -> UpdateInfo:
        """The fields beside the tensor lists, checked; `problems`, the lists', come first."""
        packed = data.get("packed", False)
        size = data.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)
        nbuf = data.get("packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS)
        version = data.get("weight_version")
        if not isinstance(packed, bool):
            problems.append(f"packed must be true or false, got {packed!r}")
        if not (_is_int(size) and size > 0):
            problems.append(f"packed_buffer_size_bytes must be a positive integer, got {size!r}")
        if not (_is_int(nbuf) and 1 <= nbuf <= MAX_NUM_BUFFERS):
            problems.append(f"packed_num_buffers must be an integer in 1..{MAX_NUM_BUFFERS}, got {nbuf!r}")
        if not (version is None or _is_int(version) or isinstance(version, str)):
            problems.append(f"weight_version must be an integer, a string or null, got {version!r}")
        lora_name, lora_config = data.get("lora_name"), data.get("lora_config")
        if lora_name is not None and not (isinstance(lora_name, str) and lora_name):
            problems.append(f"lora_name must be a non-empty string, got {lora_name!r}")
        if lora_config is not None and (lora_name is None or not isinstance(lora_config, Mapping)):
            problems.append("lora_config must be an object (PEFT's adapter_config), and comes with lora_name")
        if problems:
            raise InvalidUpdateError("update_info: " + "; ".join(problems))
        return cls(
            names,
            dtypes,
            shapes,
            packed,
            size,
            nbuf,
            version,
            data.get("ipc_handles"),
            lora_name,
            None if lora_config is None else dict(lora_config),
        )

    @property
    def is_reference(self) -> bool:
        """The ipc backend's reference to the last document the server accepted."""
        return is_reference(self)

    def num_elements(self) -> int:
        """The elements the shapes announce (0 for a reference: the document it names was
        counted when it came)."""
        return sum(map(math.prod, self.shapes))


def is_reference(info: Mapping[str, Any] | UpdateInfo) -> bool:
    handles = info.ipc_handles if isinstance(info, UpdateInfo) else info.get("ipc_handles")
    return isinstance(handles, Mapping) and "same_as" in handles


def _tensor_list_problems(names: list, dtypes: list, shapes: list) -> list[str]:
    """What is wrong with update_info's three parallel lists. A model with many experts
    sends tens of thousands of names every step, so the common case (nothing wrong) is
    checked in bulk, and only a failure is examined item by item."""
    if set(map(type, names)) <= {str} and set(map(type, dtypes)) <= {str} and set(map(type, shapes)) <= {list}:
        dims = list(itertools.chain.from_iterable(shapes))
        unique = set(names)
        if (
            set(dtypes) <= _KNOWN_DTYPES
            and set(map(type, dims)) <= {int}
            and len(unique) == len(names)
            and "" not in unique
            and min(dims, default=0) >= 0
            and max(dims, default=0) <= MAX_DIM
            and max(map(len, shapes), default=0) <= MAX_RANK
        ):
            return []
    problems = []
    bad_names = [f"[{i}] {n!r}" for i, n in enumerate(names) if not (isinstance(n, str) and n)]
    if bad_names:
        problems.append(f"names must be non-empty strings: {listing(bad_names)}")
    label = [n if isinstance(n, str) else f"[{i}]" for i, n in enumerate(names)]
    bad_dtypes = [f"{label[i]} ({d!r})" for i, d in enumerate(dtypes) if not (type(d) is str and d in _KNOWN_DTYPES)]
    if bad_dtypes:
        problems.append(f"dtype_names: unknown dtype for {listing(bad_dtypes)} (known: {', '.join(DTYPE_NAMES)})")
    bad_shapes = [
        f"{label[i]} ({s!r})"[:200]
        for i, s in enumerate(shapes)
        if not (isinstance(s, list) and len(s) <= MAX_RANK and all(_is_int(d) and 0 <= d <= MAX_DIM for d in s))
    ]
    if bad_shapes:
        problems.append(
            f"shapes must be lists of at most {MAX_RANK} int64 non-negative integers: {listing(bad_shapes)}"
        )
    counts = Counter(n for n in label if isinstance(n, str))
    dups = sorted(n for n, count in counts.items() if count > 1)
    if dups:
        problems.append(f"names: duplicates {listing(dups)}")
    return problems
