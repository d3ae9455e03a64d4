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

import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rlserve.model.base import (  # the model says what it accepts; an update is vetted against it
    ExpectedParam,
    ExpectedWeights,
)

from ..errors import InvalidUpdateError
from ..group import DEFAULT_TIMEOUT_S, TransferGroup
from ..handshake import TrainerPlan, fetch_plan, receiver_handshake, report_done
from ..info import InitInfo, UpdateInfo, listing
from ..packing import DTYPES, TensorMeta, plan_buckets, plan_digest, plan_json, tensor_metas
from ..pipeline import receive_buckets


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
        problems.append(f"unknown parameter names: {listing(unknown)}")
    if wrong_shape:
        problems.append(f"wrong shapes: {listing(wrong_shape)}")
    if not_float:
        problems.append(f"non-floating dtypes (weights must be floating point): {listing(not_float)}")
    if twice:
        problems.append(f"sent twice: {listing(twice)}")
    if missing:
        ordered = [n for n in expected if n in missing]
        problems.append(f"missing required parameters: {listing(ordered)}{_stacked_hint(ordered, expected)}")
    if problems:
        raise InvalidUpdateError("update_info refused: " + "; ".join(problems))


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
    return f" (or stacked: {listing(stacked)})" if stacked else ""


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
    metas = tensor_metas(info)
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
    (so another thread can `abort()` it) and calls `connect()` itself. `init_info`: parsed
    already (the server's ranks get it so), or the trainer's JSON, parsed here."""
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
    `update_info`: parsed already (the server's ranks get it so), or the trainer's JSON,
    parsed here. `validate`: a further check of the tensor list (raising
    InvalidUpdateError), made with the others, before any byte moves.

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
