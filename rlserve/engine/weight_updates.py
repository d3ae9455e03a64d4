"""The engine's one owner of live weight updates: a state machine, driven by the engine
loop (core_proc.py), which only carries its calls and answers.

    idle --init--> ready --update--> received --(between two steps)--> applied: version, prefix reset
                   ready --start--> open --update (a part)-->* staged --finish--> committed
                                    open --init | shutdown | sleep | timeout--> abandoned (nothing served changes)

A transaction (weight_transaction.py) has an owner, named at its start; the copy between
data-parallel replicas is peer_copy.py's. After a level-2 sleep (or a dummy start) the
model holds nothing worth serving: only a complete update (every required weight, over
all of a transaction's parts) ends that.

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
from typing import TYPE_CHECKING, Any

from rlserve.engine.peer_copy import PeerCopy
from rlserve.engine.state import asleep_refusal
from rlserve.engine.weight_checker import WeightChecker
from rlserve.engine.weight_transaction import Transaction, Transactions
from rlserve.errors import ConflictError
from rlserve.model.base import skipped
from rlserve.sampling_params import InvalidRequestError
from rlserve.weight_transfer.info import UpdateInfo
from rlserve.wire.control import TransferShutDown, WeightsUpdated, WeightVersionSet
from rlserve.wire.messages import (
    LATER,
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
from rlserve.wire.weight_version import WeightVersion, parse_version
from rlserve.worker import calls as rank

if TYPE_CHECKING:
    from rlserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

Answer = Callable[..., None]  # answer(call, value) or answer(call, error=exception)
Handler = Callable[[Call, Any], Any]  # handler(call, call.body): the answer, or LATER
_AdapterUpdate = tuple[str, dict]  # an adapter's update: (name, its config for the workers)


@dataclass
class _Received:
    call: Call
    version: WeightVersion | None
    num_bytes: int
    receive_seconds: float
    lora: _AdapterUpdate | None
    error: BaseException | None = None  # the receive failed
    skipped: int = 0  # names the model took and dropped (a multimodal trainer's vision tower)


class WeightUpdates:
    def __init__(self, core: EngineCore, answer: Answer, timeout_s: float = 120.0) -> None:
        self.core = core
        self.answer = answer
        self.received: queue.SimpleQueue[_Received] = queue.SimpleQueue()
        self.transfer: Call | None = None  # the init or receive under way, if any
        self.commits = 0  # weights copied in (a checksum read meanwhile is read again)
        self.transactions = Transactions(self, timeout_s)
        self.checker = WeightChecker(self)
        peers = PeerCopy(self)
        self.handlers: dict[type, Handler] = {  # the loop runs them; LATER: answered through `answer`
            InitWeightTransfer: self._init,
            UpdateWeights: self._update,
            StartWeightUpdate: self.transactions.start,
            FinishWeightUpdate: self.transactions.finish,
            SetWeightVersion: self._set_version,
            ShutdownWeightTransfer: self._shutdown_transfer,
            WeightChecksums: self.checker.handle,
            WeightsLayout: peers.layout,
            CopyWeightsToPeer: peers.to_peer,
            CopyWeightsFromPeer: peers.from_peer,
        }

    @property
    def transaction(self) -> Transaction | None:
        """The open transaction, if any."""
        return self.transactions.open

    def end(self, why: str) -> None:
        """Abandon the open transaction, and tell its owner at its next part or finish."""
        self.transactions.end(why)

    def abandon(self, why: str) -> None:
        """Close the open transaction without committing it."""
        self.transactions.abandon(why)

    @property
    def busy(self) -> bool:
        """A thread is waiting on the trainer: the loop looks at `received` often."""
        return self.transfer is not None or not self.received.empty()

    def beside(self, name: str, fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, name=f"rlserve-{name}", daemon=True).start()

    def _done(self, call: Call) -> None:
        if self.transfer is call:
            self.transfer = None

    # -- joining the trainer's group ------------------------------------------------------
    # A new init replaces whatever transfer is under way (the trainer started over: the
    # pending init or receive fails at once), and abandons an open transaction.
    def _init(self, call: Call, body: InitWeightTransfer) -> Any:
        if self.transfer is not None:
            self.core.executor.abort_transfer("replaced by a newer /init_weight_transfer_engine")
        self.abandon("a new /init_weight_transfer_engine")
        self.transactions.expired = None  # the trainer started over
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

        self.beside("init-transfer", join)
        return LATER

    # -- receiving an update (or one part of a transaction) ----------------------------------
    def _update(self, call: Call, body: UpdateWeights) -> Any:
        if self.transfer is not None:
            raise ConflictError(
                f"update_weights: {type(self.transfer.body).__name__} is still under way; "
                "send /update_weights once it has answered"
            )
        update_info, txn = body.update_info, self.transaction
        lora, version = None, body.weight_version
        refusal: InvalidRequestError | ConflictError | None = None
        try:
            if txn is not None:  # another owner's part: refused, and the open transaction left alone
                try:
                    txn.check_owner(body.transaction_id, "update_info.transaction_id")
                except ConflictError:
                    txn = None
                    raise
            if body.refusal is not None:  # the API server refused it: the trainer hears it here
                raise InvalidRequestError(body.refusal, body.refusal_param or "update_info")
            if txn is None and body.transaction_id is not None:
                raise ConflictError(
                    f"update_info.transaction_id: {body.transaction_id!r:.80} is not open "
                    f"({self.transactions.expired or 'no weight update is open'}); taken alone, this part "
                    "would be applied as a whole update, so it is refused"
                )
            refusal = asleep_refusal(self.core.state) or self.transactions.refusal(txn)
            if refusal is None and txn is not None:
                refusal = self.transactions.staging_refusal(txn, update_info)
            if refusal is None and update_info is not None and update_info.lora_name is not None:
                if txn is not None:
                    raise InvalidRequestError(
                        "update_info.lora_name: an adapter is updated in one /update_weights, outside a transaction",
                        "update_info",
                    )
                lora = (update_info.lora_name, self.core.require_lora().update_config(update_info))
        except (InvalidRequestError, ConflictError) as e:
            refusal = e
        self.transfer = call
        if txn is not None:
            txn.touched = time.monotonic()
            if refusal is not None and txn.failure is None:
                txn.failure = refusal
        if refusal is not None:
            drop = txn is not None  # it commits nothing now: free what it staged
            self.beside("refuse-update", lambda: self._refuse(call, refusal, drop))
            return LATER
        assert update_info is not None  # None comes with the API server's refusal, answered above
        if txn is not None:
            txn.num_elements += update_info.num_elements()
        transfer = self.core.config.weight_transfer
        if transfer is not None and transfer.backend == "ipc":
            # An IPC receive opens handles to the trainer's memory and waits on nobody: done
            # here, between two steps, it saves a thread and a hop on every push.
            self._receive(call, update_info, version, lora)
            self.apply_received()
        else:
            self.beside("receive-update", lambda: self._receive(call, update_info, version, lora))
        return LATER

    def _refuse(self, call: Call, refusal: Exception, drop: bool) -> None:
        """Refused before any byte moved: a trainer sending it hears so at once, and the
        group stays in step."""
        try:
            self.core.executor.collective_rpc(rank.RefuseUpdate(str(refusal)))
            if drop:
                self.core.executor.collective_rpc(rank.DropStaged())
        finally:
            self._done(call)
            self.answer(call, error=refusal)

    def _receive(
        self, call: Call, update_info: UpdateInfo, version: WeightVersion | None, lora: _AdapterUpdate | None
    ) -> None:
        """Receive into staging (on the thread), then hand it, or the failure, to the loop."""
        t0 = time.perf_counter()
        part = self.transaction is not None
        try:
            sizes = self.core.executor.collective_rpc(
                rank.ReceiveWeights(update_info, None if lora is None else lora[1], part)
            )
        except Exception as e:
            try:
                self.core.executor.collective_rpc(rank.DropStaged())  # a failed part fails them all
            finally:
                self.received.put(_Received(call, None, 0, 0.0, None, e))
            return
        self.received.put(
            _Received(call, version, sizes[0], time.perf_counter() - t0, lora, skipped=self._skipped(update_info, lora))
        )

    def _skipped(self, update_info: UpdateInfo, lora: _AdapterUpdate | None) -> int:
        if lora is not None:
            return 0
        return skipped(update_info.names, self.core.executor.expected_weights)

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
        self.transactions.expire_idle()

    def _record_failure(self, call: Call, error: BaseException) -> None:
        txn = self.transaction
        if txn is not None and txn.failure is None:
            txn.failure = error  # the other parts are dropped with it: finish commits nothing
        self.answer(call, error=error)

    def _staged_part(self, txn: Transaction, got: _Received) -> None:
        txn.parts += 1
        txn.num_bytes += got.num_bytes
        txn.touched = time.monotonic()
        self.answer(
            got.call,
            WeightsUpdated(
                message="Weights updated",
                staged=True,
                part=txn.parts,
                weight_version=self.core.weight_version,
                num_bytes=got.num_bytes,
                receive_seconds=got.receive_seconds,
                apply_seconds=0.0,
                skipped=got.skipped,
            ),
        )

    def _apply(self, got: _Received) -> None:
        t0 = time.perf_counter()
        try:
            version = self.commit(got.version, got.lora)
        except Exception as e:
            self.answer(got.call, error=e)
            return
        self.answer(
            got.call,
            WeightsUpdated(
                message="Weights updated",
                weight_version=version,
                num_bytes=got.num_bytes,
                receive_seconds=got.receive_seconds,
                apply_seconds=time.perf_counter() - t0,
                skipped=got.skipped,
            ),
        )

    def commit(self, version: WeightVersion | None, lora: tuple[str, dict] | None = None, parts: bool = False) -> int:
        """Copy what every rank staged into the model, now (between two steps, so no step
        ever sees a half-updated model), and number the new weights. Without weights worth
        keeping (a level-2 sleep, a dummy start), a transaction's parts must together carry
        every required weight, or nothing is copied (a whole update is checked so on receipt)."""
        refusal = asleep_refusal(self.core.state)
        if refusal is not None:
            self.core.executor.collective_rpc(rank.DropStaged())
            raise refusal
        if lora is not None:
            self.core.require_lora().apply_update(*lora)
        else:
            complete = parts and self.core.state.no_weights
            try:
                self.core.executor.collective_rpc(rank.ApplyStaged(complete=complete))
            except Exception:
                self.drop_parts()  # a rank that refused must not leave another's staging behind
                raise
            self.core.state.no_weights = False  # every required weight is in place now
        self.commits += 1
        return self.core.new_weight_version(version)

    def drop_parts(self) -> None:
        """Free what every rank staged (a transaction's parts), committing nothing."""
        try:
            self.core.executor.collective_rpc(rank.DropStaged())
        except Exception as e:  # a lost rank: the loop finds out at the next step
            logger.warning("dropping the staged parts failed: %s", e)

    # -- the other calls ------------------------------------------------------------------------
    def _set_version(self, call: Call, body: SetWeightVersion) -> WeightVersionSet:
        version = parse_version(body.new_version, "new_version")  # parsed already: the engine's own check
        number = self.core.new_weight_version(version, reset_prefix_cache=False)
        return WeightVersionSet(True, self.core.weight_label, number)

    def _shutdown_transfer(self, call: Call, body: ShutdownWeightTransfer) -> TransferShutDown:
        self.abandon(body.reason)
        if self.transfer is not None:
            self.core.executor.abort_transfer(body.reason)
        if self.transfer is not None:
            raise ConflictError(
                "shutdown_weight_transfer_engine: a transfer is under way; it failed "
                "now, call again once it has answered"
            )
        self.core.executor.collective_rpc(rank.CloseTransfer(body.reason))
        return TransferShutDown("Weight transfer engine shut down")
