"""One rank's side of live weight updates: the trainer's group, the staged tensors, the
copy into the model, and the replica-to-replica copy of data parallel.

The engine (rlserve/engine/weight_updates.py) decides; this object does what it is told
on its rank. A receive fills staging and leaves the model alone; `apply`, run between two
steps, copies staging into the model. Inside a transaction (/start_weight_update) each
receive is one part, checked on its own (nothing is required of a part) and kept until
`apply` copies every part at once, or `drop` forgets them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from rlserve.model.base import CausalLM, copy_all, missing_weights
from rlserve.model.peft import LoRAConfig, pair_tensors, peft_name
from rlserve.weight_transfer import (
    ExpectedParam,
    ExpectedWeights,
    InitInfo,
    InvalidUpdateError,
    TensorMeta,
    TransferGroup,
    UpdateInfo,
    WeightTransferError,
    receive_weights,
    receiver_init,
    refuse,
)
from rlserve.weight_transfer.server.ipc_receiver import IPCReceiver
from rlserve.weight_transfer.server.peer import copy_parameters, layout_digest
from rlserve.weight_transfer.server.receiver import listing

if TYPE_CHECKING:
    from rlserve.model.lora import LoRAModel

logger = logging.getLogger(__name__)

# An adapter update's config, the PEFT tensors it may carry, and the check of their pairing.
_LoRAExpected = tuple[LoRAConfig, dict[str, ExpectedParam], Callable[[Sequence[TensorMeta]], None]]


class WeightReceiver:
    def __init__(
        self, model: CausalLM, device: torch.device, dtype: torch.dtype, lora: LoRAModel | None, rank: int
    ) -> None:
        self.model, self.device, self.dtype, self.lora, self.rank = model, device, dtype, lora, rank
        # Taken while the parameters have their real shapes (sleep empties them). One
        # object: the IPC receiver skips re-checking a document against the same checks.
        self.expected: ExpectedWeights = model.expected_weights()
        self._optional = ExpectedWeights(
            {n: dataclasses.replace(e, required=False) for n, e in self.expected.items()},
            self.expected.skipped_prefixes,
        )
        self.group: TransferGroup | None = None
        self._connecting: TransferGroup | None = None  # a transfer group whose init is under way (abortable)
        self.ipc: IPCReceiver | None = None
        self.lora_ipc: dict[str, IPCReceiver] = {}  # adapter name -> its own handles (kept open)
        self._lora_plans: dict = {}  # target -> (staged tensors, LoRAConfig, LoadPlan) of its last update
        self._lora_memo: tuple[dict, _LoRAExpected] | None = None  # (wire config, what _lora_expected made of it)
        # (staged views, [(target, source)]) while the trainer's storage stays put
        self._ipc_plan: tuple[list, list] | None = None
        self.staged: list | None = None
        self.staged_lora: LoRAConfig | None = None
        self.parts: list[list] = []  # a transaction's received parts
        self._lock = threading.Lock()  # one receive (or refusal) at a time

    # -- the group -----------------------------------------------------------------------
    def join(self, backend: str, init_info: InitInfo | None, timeout_s: float) -> None:
        """Join the trainer's group at rank rank_offset + this rank (ipc: nothing to join;
        the trainer's handles arrive with each update). Returns within about timeout_s
        whatever the master does; a newer join (or `abort`, from any thread) stops it."""
        self.abort("replaced by a newer /init_weight_transfer_engine")
        self.close()
        if backend == "ipc":
            self.ipc = IPCReceiver(self.device)
            return
        assert init_info is not None  # parsed by the API server: only the ipc backend sends none
        group = receiver_init(
            backend, init_info, worker_rank=self.rank, device=self.device, timeout_s=timeout_s, connect=False
        )
        self._connecting = group
        try:
            group.connect()
        finally:
            if self._connecting is group:
                self._connecting = None
        if group.broken is not None:  # aborted just as it connected
            group.close()
            group.check_usable()
        self.group = group
        # Read by the test suite, which checks that every group it forms stays on loopback.
        logger.info(
            "joined the trainer's %s weight-transfer group at %s as rank %d of %d",
            backend,
            group.master,
            group.rank,
            group.world_size,
        )

    def abort(self, reason: str = "aborted") -> None:
        """Thread-safe: stop a pending join, and fail a receive in progress (the group is
        then unusable until the next join)."""
        for group in (self._connecting, self.group):
            if group is not None and group.broken is None:
                group.abort(reason)

    def close(self) -> None:
        group, self.group = self.group, None
        self.ipc = None
        self.lora_ipc = {}
        self._lora_plans = {}  # they hold views of the trainer's memory
        self._ipc_plan = None
        self.parts = []
        if group is not None:
            group.close()

    def _usable_group(self) -> TransferGroup:
        group = self.group
        if group is None or group.broken:
            why = f"is unusable ({group.broken})" if group is not None else "is not initialized"
            raise InvalidUpdateError(f"the weight-transfer group {why}: call /init_weight_transfer_engine first")
        return group

    @property
    def busy(self) -> bool:
        """A receive (or refusal) holds this worker: another now would be refused."""
        return self._lock.locked()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One receive (or refusal) at a time: a second is refused, never interleaved."""
        if not self._lock.acquire(blocking=False):
            raise InvalidUpdateError(
                "another weight update is in progress on this worker: send /update_weights one at a time"
            )
        try:
            yield
        finally:
            self._lock.release()

    # -- receive -------------------------------------------------------------------------
    def receive(self, update_info: UpdateInfo, lora_config: dict | None = None, part: bool = False) -> int:
        """Receive a whole update (or, with `part`, one part of a transaction) into staging;
        the model is untouched until `apply`. Returns the number of bytes received.

        ipc: staging is views into the trainer's memory, opened (once) and checked here
        (a part is copied out: the trainer may move on before the transaction commits).
        `lora_config` (LoRAConfig.to_wire): an adapter's PEFT tensors, checked against it.
        """
        with self._exclusive():
            self.staged = self.staged_lora = None
            validate, config = None, None
            if lora_config is not None:
                config, expected, validate = self._lora_expected(lora_config)
            else:
                expected = self._optional if part else self.expected
            if self.ipc is not None:
                receiver = self.ipc
                if update_info.lora_name is not None:  # each adapter keeps its own handles open
                    receiver = self.lora_ipc.setdefault(update_info.lora_name, IPCReceiver(self.device))
                staged = receiver.receive(update_info, expected, validate)
                if part:
                    staged = [(n, t.clone()) for n, t in staged]
            else:
                staged = receive_weights(
                    self._usable_group(),
                    update_info,
                    expected,
                    device=self.device,
                    target_dtype=self.dtype,
                    validate=validate,
                )
            if part:
                self.parts.append(staged)
            else:
                self.staged, self.staged_lora = staged, config
            return sum(t.numel() * t.element_size() for _, t in staged)

    def _lora_expected(self, wire: dict) -> _LoRAExpected:
        """An adapter update's config, the PEFT names and full shapes it may carry (staged
        in float32: the scaling is applied on the copy), and the check that its tensors
        come in A/B pairs, made before any byte moves."""
        if self.lora is None:
            raise InvalidUpdateError("update_info.lora_name: this server was started without --enable-lora")
        memo = self._lora_memo  # a trainer pushing one adapter sends one config
        if memo is not None and memo[0] == wire:
            return memo[1]
        config = LoRAConfig.parse(wire, "update_info.lora_config", self.lora.max_rank)
        expected = {}
        for module in self.lora.targets:
            a, b = self.lora.module_shapes(module, config.rank(module))
            expected[peft_name(module, "A")] = ExpectedParam(a, False, torch.float32)
            expected[peft_name(module, "B")] = ExpectedParam(b, False, torch.float32)

        exempt = self.lora.exempt

        def validate(metas: Sequence[TensorMeta]) -> None:
            try:
                pair_tensors(
                    ((m.name, torch.empty(m.shape, device="meta")) for m in metas), config, "update_info", exempt
                )
            except ValueError as e:
                raise InvalidUpdateError(str(e)) from None

        self._lora_memo = (wire, (config, expected, validate))
        return config, expected, validate

    def refuse(self, message: str) -> None:
        """The engine refused this update before receiving it (asleep, a bad weight_version,
        ...): tell a trainer that is sending it, so its trainer_send_weights raises `message`
        at once, and keep the group in step for the next push. Waits at most a couple of
        seconds for the trainer; never raises (the caller answers the refusal itself)."""
        group = self.group
        if self.ipc is not None or group is None or group.broken:
            return  # no group to tell: the trainer's own call fails on its own
        try:
            with self._exclusive():
                refuse(group, message)
        except (WeightTransferError, ValueError) as e:
            logger.warning("could not pass the refusal of an update to the trainer: %s", e)

    # -- apply ---------------------------------------------------------------------------
    def apply(self, lora_target: int | str | None = None, complete: bool = False) -> None:
        """Copy the staged update (or every staged part) into the model; an adapter update
        goes to `lora_target` (a slot, or the name of a host copy: rlserve.model.lora).
        `complete`: the parts together must carry every required weight (the model holds
        none worth keeping: after a level-2 sleep, or a dummy start), else nothing is
        copied and the missing names are listed."""
        if complete and self.parts and self.staged_lora is None:
            missing = missing_weights(self.expected, (n for part in self.parts for n, _ in part))
            if missing:
                self.drop()
                raise InvalidUpdateError(
                    f"update_info: the transaction's parts leave the model incomplete "
                    f"(the weights were dropped, so every one must be sent): missing "
                    f"required parameters: {listing(missing)}"
                )
        staged, self.staged = self.staged, None
        lora, self.staged_lora = self.staged_lora, None
        parts, self.parts = self.parts, []
        if parts and lora is None:
            for part in parts:  # in order: a later part may send what an earlier one did
                copy_all(self.model.copy_pairs(part))
        elif staged is None:
            raise RuntimeError("no staged weights to apply")
        elif lora is not None:
            self._apply_lora(staged, lora, lora_target)
        elif self.ipc is None:
            copy_all(self.model.copy_pairs(staged))
        else:
            self._apply_ipc(staged)
        if self.device.type == "cuda":
            # Staging came from the transfer's own streams (or is the trainer's memory):
            # the copies out of it finish before it is handed out again, or the trainer hears.
            torch.cuda.current_stream(self.device).synchronize()

    def _apply_lora(self, staged: list, lora: LoRAConfig, target: int | str | None) -> None:
        if target is None:
            raise RuntimeError("a staged LoRA update needs its slot or host copy")
        assert self.lora is not None  # staged only where _lora_expected found the slots
        # A trainer's IPC views are the same list push after push: its plan is kept.
        # Staging buffers (gloo, NCCL) are new each time, and not kept alive by a plan.
        cached = self._lora_plans.get(target)
        if cached is None or cached[0] is not staged or cached[1] != lora:
            cached = (staged, lora, self.lora.plan(target, pair_tensors(staged, lora, "update_info"), lora.scaling))
            if self.ipc is not None:
                self._lora_plans[target] = cached
        self.lora.run(cached[2])

    def _apply_ipc(self, staged: list) -> None:
        # The receiver hands back the same views while the trainer's storage stays put, so
        # the (target, source) pairs are worked out once; sleep and wake reset them.
        plan = self._ipc_plan
        if plan is None or plan[0] is not staged:
            plan = self._ipc_plan = (staged, self.model.copy_pairs(staged))
        copy_all(plan[1])

    def drop(self) -> None:
        """Forget what is staged (a refused or abandoned update, or transaction)."""
        self.staged = self.staged_lora = None
        self.parts = []

    def forget_storage(self) -> None:
        """The model's storage is being given back or replaced (sleep, wake-up)."""
        self._ipc_plan = None

    def forget_plan(self, target: int | str) -> None:
        self._lora_plans.pop(target, None)

    def forget_adapter(self, name: str) -> None:
        """An adapter unloaded, or evicted from host memory: its plan and IPC handles go."""
        self._lora_plans.pop(name, None)
        self.lora_ipc.pop(name, None)

    # -- what the model serves -------------------------------------------------------------
    def checksums(self) -> dict[str, str]:
        """A stable digest of each parameter's bytes as this rank holds it (its shard)."""
        out = {}
        for name, p in self.model.named_parameters():
            data = p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
            out[name] = hashlib.sha256(data.tobytes()).hexdigest()
        return out

    def reset(self) -> None:
        """Noise over every parameter, in place (what an update must then overwrite whole)."""
        with torch.no_grad():
            for _, p in self.model.named_parameters():
                if p.is_floating_point():
                    p.data.uniform_(-0.05, 0.05)

    # -- a new data-parallel replica takes a healthy one's weights (weight_transfer/server/peer.py)
    def layout(self) -> str:
        return layout_digest(self.model)

    def copy_peer(self, send: bool, address: str, ports: list[int], digest: str | None, timeout_s: float) -> int:
        return copy_parameters(
            self.model,
            send=send,
            address=address,
            port=ports[self.rank],
            device=self.device,
            digest=digest,
            timeout_s=timeout_s,
        )
