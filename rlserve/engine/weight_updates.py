"""The engine's one owner of live weight updates: a state machine, driven by the engine
loop (core_proc.py), which only carries its calls and answers.

    idle --init--> ready --update--> received --(between two steps)--> applied: version, prefix reset
                   ready --start--> open --update (a part)-->* staged --finish--> committed
                                    open --start | shutdown | timeout--> abandoned (nothing served changes)

Joining a trainer's group and receiving an update wait on the trainer: they run on a
thread of their own while the loop steps on. What the thread received waits in
`received` (a queue) until the loop, between two steps, calls `apply_received`; every
answer goes out through `answer`, the loop's callback. A failure at any point leaves the
previous weights serving and the trainer told at once (its trainer_send_weights raises
the same message): a refused update is refused on every rank, a transaction commits all
of its parts or none.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlserve.errors import ConflictError
from rlserve.sampling_params import InvalidRequestError
from rlserve.wire.messages import (
    Call,
    CopyWeightsFromPeer,
    CopyWeightsToPeer,
    FinishWeightUpdate,
    InitWeightTransfer,
    SetWeightVersion,
    ShutdownWeightTransfer,
    StartWeightUpdate,
    UpdateWeights,
    WeightChecksums,
    WeightsLayout,
)
from rlserve.model.base import skipped
from rlserve.worker import calls as rank

logger = logging.getLogger(__name__)

Answer = Callable[..., None]  # answer(call, value) or answer(call, error=exception)
Handler = Callable[[Call, Any], Any]  # handler(call, call.body): the answer, or LATER


_MAX_VERSION = (1 << 63) - 1  # a version travels as a 64-bit integer with every step's tokens


def parse_version(version: Any, field: str = "weight_version") -> int | None:
    """A weight version as vLLM sends it (a string, or an integer), as rlserve numbers it."""
    if version is None:
        return None
    if isinstance(version, str) and version.strip().isdigit() and len(version) <= 64:
        version = int(version)
    if isinstance(version, int) and not isinstance(version, bool) and 0 <= version <= _MAX_VERSION:
        return version
    raise InvalidRequestError(
        f"{field}: rlserve numbers weight versions (every token's version is reported), so it must be "
        f"an integer in 0..{_MAX_VERSION}, or a string of its digits, got {version!r:.200}", field)


def asleep_refusal(core) -> InvalidRequestError | None:
    """The one rule for an asleep engine: wake up first (its weight storage is given back)."""
    if core.sleeping:
        return InvalidRequestError("the server is asleep: POST /wake_up before updating weights",
                                   "update_info")
    return None


@dataclass
class _Received:
    call: Call
    version: int | None
    num_bytes: int
    receive_seconds: float
    lora: tuple[str, dict] | None  # an adapter's update: (name, its config for the workers)
    error: BaseException | None = None  # the receive failed
    skipped: int = 0  # names the model took and dropped (a multimodal trainer's vision tower)


@dataclass
class Transaction:
    """An update in parts: /start_weight_update ... /finish_weight_update."""

    number: int
    opened: float
    touched: float  # the last call of it: its timeout counts from there
    parts: int = 0
    num_bytes: int = 0
    failure: BaseException | None = None  # the first part that failed: finish commits nothing

    def describe(self) -> str:
        return (f"weight update transaction {self.number} (opened {time.monotonic() - self.opened:.0f}s ago, "
                f"{self.parts} part(s) staged)")


class WeightUpdates:
    def __init__(self, core, answer: Answer, timeout_s: float = 120.0):
        self.core = core
        self.answer = answer
        self.timeout_s = timeout_s  # an open transaction left alone this long is abandoned
        self.received: queue.SimpleQueue[_Received] = queue.SimpleQueue()
        self.transfer: Call | None = None  # the init or receive under way, if any
        self.transaction: Transaction | None = None
        self.expired: str | None = None  # why the last transaction timed out, until the next start
        self._numbers = 0
        self.handlers: dict[type, Handler] = {  # the loop runs them; LATER: answered through `answer`
            InitWeightTransfer: self._init, UpdateWeights: self._update, StartWeightUpdate: self._start,
            FinishWeightUpdate: self._finish, SetWeightVersion: self._set_version,
            ShutdownWeightTransfer: self._shutdown_transfer, WeightChecksums: self._checksums,
            WeightsLayout: self._layout, CopyWeightsToPeer: self._copy_to_peer,
            CopyWeightsFromPeer: self._copy_from_peer}

    @property
    def busy(self) -> bool:
        """A thread is waiting on the trainer: the loop looks at `received` often."""
        return self.transfer is not None or not self.received.empty()

    def _beside(self, name: str, fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, name=f"rlserve-{name}", daemon=True).start()

    def _done(self, call: Call) -> None:
        if self.transfer is call:
            self.transfer = None

    # -- joining the trainer's group ------------------------------------------------------
    # A new init replaces whatever transfer is under way (the trainer started over: the
    # pending init or receive fails at once), and abandons an open transaction.
    def _init(self, call: Call, body: InitWeightTransfer) -> Any:
        if self.transfer is not None and self.core.world_size == 1:
            self.core.executor.driver.receiver.abort("replaced by a newer /init_weight_transfer_engine")
        self.abandon("a new /init_weight_transfer_engine")
        self.expired = None  # the trainer started over
        self.transfer = call

        def join() -> None:
            try:
                self.core.executor.collective_rpc(rank.JoinTransfer(body.backend, body.init_info, body.timeout_s))
            except Exception as e:
                self.answer(call, error=e)
            else:
                self.answer(call, None)
            finally:
                self._done(call)

        self._beside("init-transfer", join)
        return LATER

    # -- receiving an update (or one part of a transaction) ----------------------------------
    def _update(self, call: Call, body: UpdateWeights) -> Any:
        if self.transfer is not None:
            raise ConflictError(f"update_weights: {type(self.transfer.body).__name__} is still under way; "
                                "send /update_weights once it has answered")
        update_info, txn = body.update_info, self.transaction
        refusal, lora, version = None, None, None
        try:
            version = parse_version(body.weight_version)
            refusal = asleep_refusal(self.core) or self._transaction_refusal(txn)
            if refusal is None and isinstance(update_info, dict) and update_info.get("lora_name") is not None:
                if txn is not None:
                    raise InvalidRequestError("update_info.lora_name: an adapter is updated in one "
                                              "/update_weights, outside a transaction", "update_info")
                lora = (update_info["lora_name"], self.core.require_lora().update_config(update_info))
        except InvalidRequestError as e:
            refusal = e
        self.transfer = call
        if txn is not None:
            txn.touched = time.monotonic()
            if refusal is not None and txn.failure is None:
                txn.failure = refusal
        if refusal is not None:
            self._beside("refuse-update", lambda: self._refuse(call, update_info, refusal))
            return LATER
        transfer = self.core.config.weight_transfer
        if transfer is not None and transfer.backend == "ipc":
            # An IPC receive opens handles to the trainer's memory and waits on nobody: done
            # here, between two steps, it saves a thread and a hop on every push.
            self._receive(call, update_info, version, lora)
            self.apply_received()
        else:
            self._beside("receive-update", lambda: self._receive(call, update_info, version, lora))
        return LATER

    def _transaction_refusal(self, txn: Transaction | None) -> InvalidRequestError | None:
        """A part of a transaction that failed, or of one abandoned at its timeout (the trainer
        does not know yet: taken alone, its part would be applied as a whole update)."""
        if txn is not None and txn.failure is not None:
            return InvalidRequestError(f"update_info: {txn.describe()} already failed ({txn.failure}): "
                                       "it commits nothing; /start_weight_update again", "update_info")
        if txn is None and self.expired is not None:
            return InvalidRequestError(f"update_info: {self.expired}; /start_weight_update again", "update_info")
        return None

    def _refuse(self, call: Call, update_info: Any, refusal: InvalidRequestError) -> None:
        """Refused before any byte moved: a trainer sending it hears so at once, and the
        group stays in step."""
        try:
            self.core.executor.collective_rpc(rank.RefuseUpdate(str(refusal)))
            if self.transaction is not None:  # it commits nothing now: free what it staged
                self.core.executor.collective_rpc(rank.DropStaged())
        finally:
            self._done(call)
            self.answer(call, error=refusal)

    def _receive(self, call: Call, update_info: Any, version: int | None, lora) -> None:
        """Receive into staging (on the thread), then hand it, or the failure, to the loop."""
        t0 = time.perf_counter()
        part = self.transaction is not None
        try:
            sizes = self.core.executor.collective_rpc(
                rank.ReceiveWeights(update_info, None if lora is None else lora[1], part))
        except Exception as e:
            try:
                self.core.executor.collective_rpc(rank.DropStaged())  # a failed part fails them all
            finally:
                self.received.put(_Received(call, None, 0, 0.0, None, e))
            return
        self.received.put(_Received(call, version, sizes[0], time.perf_counter() - t0, lora,
                                    skipped=self._skipped(update_info, lora)))

    def _skipped(self, update_info: Any, lora) -> int:
        names = update_info.get("names") if isinstance(update_info, dict) and lora is None else None
        if not isinstance(names, list):
            return 0
        return skipped([n for n in names if isinstance(n, str)], self.core.executor.driver.receiver.expected)

    def apply_received(self) -> None:
        """Between two steps (the loop's thread): apply what the threads received, and
        abandon a transaction past its timeout."""
        while True:
            try:
                got = self.received.get_nowait()
            except queue.Empty:
                break
            self._done(got.call)
            if got.error is not None:
                self._record_failure(got.call, got.error)
            elif self.transaction is not None:
                self._staged_part(self.transaction, got)
            else:
                self._apply(got)
        txn = self.transaction
        if txn is not None and self.transfer is None and time.monotonic() - txn.touched > self.timeout_s:
            self.abandon(f"no call for {self.timeout_s:.0f}s (its timeout)")
            self.expired = (f"weight update transaction {txn.number} was abandoned after {self.timeout_s:.0f}s "
                            "without a call (its timeout); nothing of it is served")

    def _record_failure(self, call: Call, error: BaseException) -> None:
        txn = self.transaction
        if txn is not None and txn.failure is None:
            txn.failure = error  # the other parts are dropped with it: finish commits nothing
        self.answer(call, error=error)

    def _staged_part(self, txn: Transaction, got: _Received) -> None:
        txn.parts += 1
        txn.num_bytes += got.num_bytes
        txn.touched = time.monotonic()
        self.answer(got.call, {"message": "Weights updated", "staged": True, "part": txn.parts,
                               "weight_version": self.core.weight_version, "num_bytes": got.num_bytes,
                               "receive_seconds": got.receive_seconds, "apply_seconds": 0.0,
                               "skipped": got.skipped})

    def _apply(self, got: _Received) -> None:
        t0 = time.perf_counter()
        try:
            version = self._commit(got.version, got.lora)
        except Exception as e:
            self.answer(got.call, error=e)
            return
        self.answer(got.call, {"message": "Weights updated", "weight_version": version,
                               "num_bytes": got.num_bytes, "receive_seconds": got.receive_seconds,
                               "apply_seconds": time.perf_counter() - t0, "skipped": got.skipped})

    def _commit(self, version: int | None, lora: tuple[str, dict] | None = None) -> int:
        """Copy what every rank staged into the model, now (between two steps, so no step
        ever sees a half-updated model), and number the new weights."""
        refusal = asleep_refusal(self.core)
        if refusal is not None:
            self.core.executor.collective_rpc(rank.DropStaged())
            raise refusal
        if lora is not None:
            self.core.lora.apply_update(*lora)
        else:
            self.core.executor.collective_rpc(rank.ApplyStaged())
            self.core.scheduler.no_weights = False  # an update carries every required weight
        return self.core.new_weight_version(version)

    # -- the transaction -----------------------------------------------------------------------
    def _start(self, call: Call, body: StartWeightUpdate) -> dict:
        if not body.is_checkpoint_format:
            raise InvalidRequestError("is_checkpoint_format: rlserve takes weights under their checkpoint "
                                      "(Hugging Face) names only; send true", "is_checkpoint_format")
        if self.transfer is not None:
            raise ConflictError(f"start_weight_update: {type(self.transfer.body).__name__} is still under "
                                "way; start once it has answered")
        if self.transaction is not None:
            what = self.transaction.describe()
            self.abandon("a new /start_weight_update")
            raise ConflictError(f"start_weight_update: {what} was still open; it is abandoned now (nothing "
                                "of it is served): call /start_weight_update again")
        self._numbers += 1
        self.expired = None
        now = time.monotonic()
        self.transaction = Transaction(self._numbers, now, now)
        return {"message": "Weight update started", "transaction": self._numbers}

    def _finish(self, call: Call, body: FinishWeightUpdate) -> dict:
        version = parse_version(body.weight_version)
        txn = self.transaction
        if txn is None:
            why, self.expired = (f": {self.expired}" if self.expired else ""), None
            raise InvalidRequestError(f"finish_weight_update: no weight update is open{why} (POST "
                                      "/start_weight_update first)", "weight_version")
        if self.transfer is not None:
            raise ConflictError(f"finish_weight_update: a part of {txn.describe()} is still being "
                                "received; finish once its /update_weights has answered")
        self.transaction = None
        if txn.failure is not None:
            self._drop_parts()
            failed = type(txn.failure)
            message = (f"finish_weight_update: nothing was committed: a part of weight update "
                       f"transaction {txn.number} failed: {txn.failure}")
            raise (failed(message, "update_info") if issubclass(failed, InvalidRequestError) else failed(message))
        t0 = time.perf_counter()
        if txn.parts:
            new = self._commit(version)
        else:
            new = self.core.new_weight_version(version)
        logger.info("weight update transaction %d committed: %d part(s), %.1f MB, version %d",
                    txn.number, txn.parts, txn.num_bytes / 1e6, new)
        return {"message": "Weight update finished", "weight_version": new, "parts": txn.parts,
                "num_bytes": txn.num_bytes, "apply_seconds": time.perf_counter() - t0}

    def abandon(self, why: str) -> None:
        """Close an open transaction without committing it."""
        txn, self.transaction = self.transaction, None
        if txn is None:
            return
        logger.warning("%s abandoned: %s; nothing of it is served", txn.describe(), why)
        self._drop_parts()

    def _drop_parts(self) -> None:
        try:
            self.core.executor.collective_rpc(rank.DropStaged())
        except Exception as e:  # a lost rank: the loop finds out at the next step
            logger.warning("dropping the staged parts failed: %s", e)

    # -- the other calls ------------------------------------------------------------------------
    def _set_version(self, call: Call, body: SetWeightVersion) -> dict:
        version = parse_version(body.new_version, "new_version")
        self.core.new_weight_version(version, reset_prefix_cache=False)
        return {"success": True, "new_version": str(version)}

    def _shutdown_transfer(self, call: Call, body: ShutdownWeightTransfer) -> dict:
        self.abandon("/shutdown_weight_transfer_engine")
        if self.transfer is not None and self.core.world_size == 1:
            self.core.executor.driver.receiver.abort("the weight-transfer engine was shut down")
        if self.transfer is not None:
            raise ConflictError("shutdown_weight_transfer_engine: a transfer is under way; it failed "
                                "now, call again once it has answered")
        self.core.executor.collective_rpc(rank.CloseTransfer())
        return {"message": "Weight transfer engine shut down"}

    def _checksums(self, call: Call, body: WeightChecksums) -> list[dict[str, str]]:
        if self.core.sleeping:
            raise ConflictError("weight_checker requires an awake, unpaused engine")
        return self.core.executor.collective_rpc(rank.Checksums())

    # A data-parallel replica that (re)joins copies a healthy replica's weights (and then
    # takes its version): the source sends between two of its steps, so the copy is one
    # version, never half of an update (updates are applied between steps too).
    def _layout(self, call: Call, body: WeightsLayout) -> list[str]:
        return self.core.executor.collective_rpc(rank.WeightsLayout())

    def _copy_to_peer(self, call: Call, body: CopyWeightsToPeer) -> dict:
        if self.core.sleeping:
            raise ConflictError("copy_weights_to_peer: this replica is asleep")
        self._check_layouts(body.digests)
        version = self.core.weight_version
        sizes = self.core.executor.collective_rpc(rank.CopyPeer(True, body.address, body.ports, None, body.timeout_s))
        return {"weight_version": version, "num_bytes": sum(int(x) for x in sizes)}

    def _copy_from_peer(self, call: Call, body: CopyWeightsFromPeer) -> dict:
        self._check_layouts(body.digests)
        sizes = self.core.executor.collective_rpc(rank.CopyPeer(False, body.address, body.ports, None, body.timeout_s))
        self.core.scheduler.no_weights = False
        self.core.new_weight_version(body.weight_version)
        return {"weight_version": body.weight_version, "num_bytes": sum(int(x) for x in sizes)}

    def _check_layouts(self, digests: list[str]) -> None:
        # Compared rank by rank here; every rank pair then copies at once.
        mine = self.core.executor.collective_rpc(rank.WeightsLayout())
        if mine != list(digests):
            raise InvalidRequestError(f"peer weight copy: parameter layouts differ ({mine} here, "
                                      f"{list(digests)} at the source)", "replica")


LATER = object()  # a call answered later, through the loop's callback
