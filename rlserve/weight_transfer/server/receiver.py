"""Server side: join the trainer's group, vet an update, receive it into staging tensors.

`receive_weights` never touches model parameters: it returns fresh tensors and
the engine applies them between steps, so a refused or failed update leaves the
previous weights serving. handshake.py pairs the request with the trainer's push;
pipeline.py moves and verifies the bytes.

Dtypes: any floating dtype is accepted and cast on copy to the staging dtype
(`ExpectedParam.dtype`, else `target_dtype`, else the sent dtype); integer and
bool tensors are refused, since a model's weights are floating point.
"""

from __future__ import annotations

import itertools
import operator
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rlserve.model.base import (  # the model says what it accepts; an update is vetted against it
    ExpectedParam,
    ExpectedWeights,
)

from ..address import address_problem
from ..errors import InvalidUpdateError
from ..group import DEFAULT_TIMEOUT_S, TransferGroup
from ..handshake import TrainerPlan, fetch_plan, receiver_handshake, report_done
from ..packing import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DTYPES,
    TensorMeta,
    plan_buckets,
    plan_digest,
    plan_json,
)
from ..pipeline import receive_buckets

MAX_NUM_BUFFERS = 8
MAX_WORLD_SIZE = (1 << 31) - 1  # NCCL's and torch.distributed's rank count is a 32-bit int
MAX_DIM = (1 << 63) - 1  # a tensor dimension is an int64 everywhere it goes
MAX_RANK = 64  # torch's limit on a tensor's dimensions
_LIST_CAP = 10


def _listing(items: Sequence[str]) -> str:
    """At most _LIST_CAP items, then how many more: messages stay readable for big models."""
    shown = ", ".join(items[:_LIST_CAP])
    return shown + (f" (and {len(items) - _LIST_CAP} more)" if len(items) > _LIST_CAP else "")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class InitInfo:
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
        problems = [f"missing {k}" for k in fields if k not in data]
        unknown = sorted(set(data) - set(fields))
        if unknown:
            problems.append(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(fields)})")
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
            limit = ("" if max_world_size == MAX_WORLD_SIZE
                     else " (weight-transfer-config max_world_size)")
            problems.append(f"world_size must be an integer up to {max_world_size}{limit}, got {world!r:.40}")
        elif _is_int(offset) and offset + num_workers > world:
            problems.append(f"world_size {world} is too small: this server has {num_workers} worker(s) "
                            f"at ranks {offset}..{offset + num_workers - 1}")
        if problems:
            raise InvalidUpdateError("init_info: " + "; ".join(problems))
        return cls(addr, port, offset, world)


@dataclass(frozen=True)
class UpdateInfo:
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
    lora_config: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> UpdateInfo:
        """Validate the trainer's update_info JSON; every problem found is reported at once."""
        if not isinstance(data, Mapping):
            raise InvalidUpdateError("update_info must be a JSON object")
        known = ("names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes",
                 "packed_num_buffers", "weight_version", "ipc_handles", "lora_name", "lora_config")
        problems = [f"{k} is required" for k in known[:3] if k not in data]
        unknown = sorted(set(data) - set(known))
        if unknown:
            problems.append(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(known)})")
        if problems:
            raise InvalidUpdateError("update_info: " + "; ".join(problems))

        names, dtypes, shapes = data["names"], data["dtype_names"], data["shapes"]
        for key, value in (("names", names), ("dtype_names", dtypes), ("shapes", shapes)):
            if not isinstance(value, list):
                problems.append(f"{key} must be a list, got {type(value).__name__}")
        if problems:
            raise InvalidUpdateError("update_info: " + "; ".join(problems))
        if not len(names) == len(dtypes) == len(shapes):
            raise InvalidUpdateError(f"update_info: names, dtype_names and shapes must have the same length, "
                                     f"got {len(names)}, {len(dtypes)} and {len(shapes)}")
        problems += _tensor_list_problems(names, dtypes, shapes)

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
        return cls(tuple(names), tuple(dtypes), tuple(map(tuple, shapes)), packed, size, nbuf, version,
                   data.get("ipc_handles"), lora_name, lora_config)

    def metas(self) -> list[TensorMeta]:
        # tuple.__new__ straight from C: TensorMeta._make costs a Python frame per name
        return list(map(tuple.__new__, itertools.repeat(TensorMeta), zip(self.names, self.dtype_names, self.shapes)))


def _tensor_list_problems(names: list, dtypes: list, shapes: list) -> list[str]:
    """What is wrong with update_info's three parallel lists. A model with many experts
    sends tens of thousands of names every step, so the common case (nothing wrong) is
    checked in bulk, and only a failure is examined item by item."""
    if set(map(type, names)) <= {str} and set(map(type, dtypes)) <= {str} and set(map(type, shapes)) <= {list}:
        dims = list(itertools.chain.from_iterable(shapes))
        unique = set(names)
        if (set(dtypes) <= DTYPES.keys() and set(map(type, dims)) <= {int} and len(unique) == len(names)
                and "" not in unique and min(dims, default=0) >= 0 and max(dims, default=0) <= MAX_DIM
                and max(map(len, shapes), default=0) <= MAX_RANK):
            return []
    problems = []
    bad_names = [f"[{i}] {n!r}" for i, n in enumerate(names) if not (isinstance(n, str) and n)]
    if bad_names:
        problems.append(f"names must be non-empty strings: {_listing(bad_names)}")
    label = [n if isinstance(n, str) else f"[{i}]" for i, n in enumerate(names)]
    bad_dtypes = [f"{label[i]} ({d!r})" for i, d in enumerate(dtypes) if not (type(d) is str and d in DTYPES)]
    if bad_dtypes:
        problems.append(f"dtype_names: unknown dtype for {_listing(bad_dtypes)} "
                        f"(known: {', '.join(DTYPES)})")
    bad_shapes = [f"{label[i]} ({s!r})"[:200] for i, s in enumerate(shapes)
                  if not (isinstance(s, list) and len(s) <= MAX_RANK
                          and all(_is_int(d) and 0 <= d <= MAX_DIM for d in s))]
    if bad_shapes:
        problems.append(f"shapes must be lists of at most {MAX_RANK} int64 non-negative integers: "
                        f"{_listing(bad_shapes)}")
    counts = Counter(n for n in label if isinstance(n, str))
    dups = sorted(n for n, count in counts.items() if count > 1)
    if dups:
        problems.append(f"names: duplicates {_listing(dups)}")
    return problems


class _ModelIndex(NamedTuple):
    """What checking a tensor list against one expected table needs, built once per table."""

    expected: Mapping[str, ExpectedParam]  # held, so its id is not reused while cached
    shapes: dict[str, tuple[int, ...]]
    required: frozenset[str]
    covering: frozenset[str]  # names that carry others (stacked experts)


_indexes: dict[int, _ModelIndex] = {}


def _model_index(expected: Mapping[str, ExpectedParam]) -> _ModelIndex:
    index = _indexes.get(id(expected))
    if index is None or index.expected is not expected:
        if len(_indexes) >= 8:  # a process checks against a few tables (whole updates, parts)
            _indexes.clear()
        index = _indexes[id(expected)] = _ModelIndex(
            expected, {n: e.shape for n, e in expected.items()},
            frozenset(n for n, e in expected.items() if e.required),
            frozenset(n for n, e in expected.items() if e.covers))
    return index


def check_against_model(metas: Sequence[TensorMeta], expected: Mapping[str, ExpectedParam]) -> None:
    """Refuse names, shapes or dtypes the model cannot take, listing the offenders. The
    lists are compared in bulk (an MoE model sends tens of thousands of names); only a
    failure is examined name by name."""
    if isinstance(expected, ExpectedWeights) and expected.skipped_prefixes:
        metas = [m for m in metas if not expected.skips(m.name)]  # received, then dropped
    index = _model_index(expected)
    names = list(map(_name_of, metas))
    sent = set(names)
    unknown, wrong_shape, twice = [], [], []
    if list(map(index.shapes.get, names)) != list(map(_shape_of, metas)):
        for name, _, shape in metas:
            e = expected.get(name)
            if e is None:
                unknown.append(_unknown(name, expected))
            elif e.shape != shape:
                wrong_shape.append(f"{name} (got {list(shape)}, expected {list(e.shape)})")
    covered: set[str] = sent
    stacked = index.covering.intersection(sent)
    if stacked:
        covered = set(sent)
        for name in (n for n in names if n in stacked):
            covers = expected[name].covers
            twice += [f"{c} (also in {name})" for c in covers if c in sent]
            covered.update(covers)
    dtypes = set(map(_dtype_of, metas))
    floats = {d for d in dtypes if DTYPES[d].is_floating_point}
    not_float = [f"{m.name} ({m.dtype_name})" for m in metas if m.dtype_name not in floats] if floats != dtypes else []
    missing = index.required.difference(covered)
    problems = []
    if unknown:
        problems.append(f"unknown parameter names: {_listing(unknown)}")
    if wrong_shape:
        problems.append(f"wrong shapes: {_listing(wrong_shape)}")
    if not_float:
        problems.append(f"non-floating dtypes (weights must be floating point): {_listing(not_float)}")
    if twice:
        problems.append(f"sent twice: {_listing(twice)}")
    if missing:
        ordered = [n for n in expected if n in missing]
        problems.append(f"missing required parameters: {_listing(ordered)}{_stacked_hint(ordered, expected)}")
    if problems:
        raise InvalidUpdateError("update_info refused: " + "; ".join(problems))


listing = _listing


_name_of, _dtype_of, _shape_of = (operator.itemgetter(i) for i in range(3))  # TensorMeta's fields


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _unknown(name: str, expected: Mapping[str, ExpectedParam]) -> str:
    """An unknown name, with why when it is an expert index past the layer's last expert."""
    match = _EXPERT.search(name)
    if match is None or _EXPERT.sub(".experts.0.", name, count=1) not in expected:
        return name
    return f"{name} (this layer has no expert {match.group(1)})"


def _stacked_hint(missing: Sequence[str], expected: Mapping[str, ExpectedParam]) -> str:
    """Say which stacked tensors could carry missing per-expert names, when any could."""
    want = set(missing)
    stacked = [n for n, p in expected.items() if p.covers and not want.isdisjoint(p.covers)]
    return f" (or stacked: {_listing(stacked)})" if stacked else ""


@dataclass(frozen=True)
class Vetted:
    """An update's tensor list once checked against the model: its metas, bucket plan and
    plan digest."""

    key: tuple
    expected: Mapping[str, Any]  # held, so its identity cannot pass to another table
    metas: list[TensorMeta]
    buckets: list
    digest: str


_last_vetted: list[Vetted] = []  # the previous update's, per process


def vet(info: UpdateInfo, expected: Mapping[str, ExpectedParam],
        validate: Callable[[Sequence[TensorMeta]], None] | None = None) -> Vetted:
    """Check the tensor list against the model and plan its buckets (InvalidUpdateError
    if it does not fit). A trainer sends the same list every step: when it equals the
    previous update's, for the same expected table and no further check, the previous
    result stands (a comparison of the lists, not tens of milliseconds of checks)."""
    key = (info.names, info.dtype_names, info.shapes, info.packed, info.packed_buffer_size_bytes)
    last = _last_vetted[0] if _last_vetted else None
    if validate is None and last is not None and last.expected is expected and last.key == key:
        return last
    metas = info.metas()
    check_against_model(metas, expected)
    if validate is not None:
        validate(metas)
    vetted = Vetted(key, expected, metas, plan_buckets(metas, info.packed, info.packed_buffer_size_bytes),
                    plan_digest(metas, info.packed, info.packed_buffer_size_bytes))
    if validate is None:
        _last_vetted[:] = [vetted]
    return vetted


def _plan_problem(group: TransferGroup, info: UpdateInfo, vetted: Vetted, trainer: TrainerPlan) -> str | None:
    """Why the trainer is about to send something other than update_info describes, if it is."""
    if trainer.digest == vetted.digest:
        return None
    metas = vetted.metas
    mine = plan_json(metas, info.packed, info.packed_buffer_size_bytes)
    theirs = fetch_plan(group, trainer.digest)
    why = "different plan layout versions"
    if theirs is None:
        why = "the trainer's plan is not in the group's store (a trainer of another version?)"
    elif theirs.get("packed") != mine["packed"] or theirs.get("bucket_size_bytes") != mine["bucket_size_bytes"]:
        why = (f"the trainer sends packed={theirs.get('packed')} with buffer size "
               f"{theirs.get('bucket_size_bytes')}, update_info says packed={mine['packed']} with "
               f"buffer size {mine['bucket_size_bytes']}")
    else:
        lists = [theirs.get(k) for k in ("names", "dtype_names", "shapes")]
        a = list(zip(*lists)) if all(isinstance(x, list) for x in lists) else []
        b = [[name, dtype, list(shape)] for name, dtype, shape in metas]
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if list(x) != y), None)
        if diff is not None:
            why = f"tensor #{diff}: the trainer sends {str(list(a[diff]))[:200]}, update_info says {b[diff]}"
        elif len(a) != len(b):
            why = f"the trainer sends {len(a)} tensors, update_info lists {len(b)}"
    return f"update_info does not match what the trainer sends: {why}"


def receiver_init(backend: str, init_info: Mapping[str, Any] | InitInfo, worker_rank: int = 0,
                  device: torch.device | str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                  connect: bool = True) -> TransferGroup:
    """Join the trainer's group at rank `rank_offset + worker_rank`; blocks (at most about
    timeout_s) until every rank is in. With connect=False the caller gets the group first
    (so another thread can `abort()` it) and calls `connect()` itself."""
    info = init_info if isinstance(init_info, InitInfo) else InitInfo.parse(init_info, worker_rank + 1)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    return TransferGroup(backend, info.master_address, info.master_port, info.rank_offset + worker_rank,
                         info.world_size, device, timeout_s, connect=connect)


def receive_weights(
    group: TransferGroup,
    update_info: UpdateInfo | Mapping[str, Any],
    expected: Mapping[str, ExpectedParam],
    device: torch.device | str | None = None,
    target_dtype: torch.dtype | None = None,
    validate: Callable[[Sequence[TensorMeta]], None] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Vet the update, then receive every tensor into fresh staging tensors on `device`.
    `validate`: a further check of the tensor list (raising InvalidUpdateError), made with
    the others, before any byte moves.

    Raises InvalidUpdateError (HTTP 400; the trainer raises the same message) on a
    refusal, WeightTransferError (HTTP 502) if no trainer came or the transfer failed:
    a bucket that arrives short, long or altered (its checksum differs) fails the whole
    update and names the bucket and its tensors.
    """
    refusal = None
    info: UpdateInfo | None = None
    vetted: Vetted | None = None
    try:
        info = update_info if isinstance(update_info, UpdateInfo) else UpdateInfo.parse(update_info)
        if info.ipc_handles is not None:
            raise InvalidUpdateError(f"update_info.ipc_handles: only the ipc backend takes handles; "
                                     f"this server receives over {group.backend}")
        vetted = vet(info, expected, validate)
    except InvalidUpdateError as e:
        refusal = str(e)

    def judge(plan: TrainerPlan) -> str | None:
        assert info is not None and vetted is not None  # judged only where nothing was refused
        return _plan_problem(group, info, vetted, plan)

    plan = receiver_handshake(group, refusal, judge)
    assert vetted is not None  # a refusal raised in the handshake
    metas = vetted.metas
    device = group.device if device is None else torch.device(device)
    staging = [_staging_dtype(expected.get(m.name)) or target_dtype or m.dtype for m in metas]
    staged = receive_buckets(group, metas, vetted.buckets, staging, device, plan.checksum)
    report_done(group, plan.turn)
    return staged


def _staging_dtype(e: ExpectedParam | None) -> torch.dtype | None:
    return None if e is None else e.dtype  # None: a name the model drops (ExpectedWeights)
