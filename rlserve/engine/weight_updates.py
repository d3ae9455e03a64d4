"""The engine's one owner of live weight updates: a state machine, driven by the engine
loop (core_proc.py), which only carries its calls and answers.

    idle --init--> ready --update--> received --(between two steps)--> applied: version, prefix reset
                   ready --start--> open --update (a part)-->* staged --finish--> committed
                                    open --init | shutdown | sleep | timeout--> abandoned (nothing served changes)

A transaction has an owner: /start_weight_update names it (`transaction_id`, given or
made), and a part or finish that carries another id is a 409, as is a second start while
one is open; a vLLM client that sends no id gets the one transaction open, as in vLLM.
After a level-2 sleep (or a dummy start) the model holds nothing worth serving: only a
complete update (every required weight, over all of a transaction's parts) ends that.

Joining a trainer's group and receiving an update wait on the trainer: they run on a
thread of their own while the loop steps on. What the thread received waits in
`received` (a queue) until the loop, between two steps, calls `apply_received`; every
answer goes out through `answer`, the loop's callback. A failure at any point leaves the
previous weights serving and the trainer told at once (its trainer_send_weights raises
the same message): a refused update is refused on every rank, a transaction commits all
of its parts or none.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlserve.engine.weight_checker import WeightChecker
from rlserve.engine.weight_transaction import Transaction
from rlserve.errors import ConflictError, PayloadTooLargeError
from rlserve.model.base import skipped
from rlserve.sampling_params import InvalidRequestError
from rlserve.weight_transfer.errors import InvalidUpdateError
from rlserve.weight_transfer.info import UpdateInfo
from rlserve.wire.control import (
    PeerCopied,
    TransferShutDown,
    WeightsUpdated,
    WeightUpdateFinished,
    WeightUpdateStarted,
    WeightVersionSet,
)
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


def asleep_refusal(core: EngineCore) -> InvalidRequestError | None:
    """The one rule for an asleep engine: wake the weights first (their storage is given
    back); the KV cache may stay asleep (vLLM's /wake_up?tags=weights, update, then kv_cache)."""
    if core.state.weights_asleep:
        return InvalidRequestError(
            "the server's weights are asleep: POST /wake_up (or /wake_up?tags=weights) before updating weights",
            "update_info",
        )
    return None


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
        self.timeout_s = timeout_s  # an open transaction left alone this long is abandoned
        self.received: queue.SimpleQueue[_Received] = queue.SimpleQueue()
        self.transfer: Call | None = None  # the init or receive under way, if any
        self.transaction: Transaction | None = None
        self.expired: str | None = None  # why the last transaction timed out, until the next start
        self._numbers = 0
        self.commits = 0  # weights copied in (a checksum read meanwhile is read again)
        self.checker = WeightChecker(self)
        self.handlers: dict[type, Handler] = {  # the loop runs them; LATER: answered through `answer`
            InitWeightTransfer: self._init,
            UpdateWeights: self._update,
            StartWeightUpdate: self._start,
            FinishWeightUpdate: self._finish,
            SetWeightVersion: self._set_version,
            ShutdownWeightTransfer: self._shutdown_transfer,
            WeightChecksums: self.checker.handle,
            WeightsLayout: self._layout,
            CopyWeightsToPeer: self._copy_to_peer,
            CopyWeightsFromPeer: self._copy_from_peer,
        }

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
                    f"({self.expired or 'no weight update is open'}); taken alone, this part "
                    "would be applied as a whole update, so it is refused"
                )
            refusal = asleep_refusal(self.core) or self._transaction_refusal(txn)
            if refusal is None and txn is not None:
                refusal = self._staging_refusal(txn, update_info)
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

    def _staging_refusal(self, txn: Transaction, update_info: UpdateInfo | None) -> InvalidRequestError | None:
        """A transaction stages at most the model's size (a trainer resending whole parts
        would otherwise grow the server's memory without bound): a 413, before any byte moves."""
        elements = 0 if update_info is None else update_info.num_elements()
        model = self.model_elements
        if txn.num_elements + elements <= model:
            return None
        return PayloadTooLargeError(
            f"update_info.shapes: this part ({elements} elements) would stage {txn.num_elements + elements} "
            f"elements in {txn.describe()}, more than the model's {model} (the cap on a transaction's "
            "staging); finish the transaction before sending more",
            "update_info",
        )

    @functools.cached_property
    def model_elements(self) -> int:
        """Elements of every tensor the model takes (stacked and per-expert names both)."""
        return sum(math.prod(e.shape) for e in self.core.executor.expected_weights.values())

    def _transaction_refusal(self, txn: Transaction | None) -> InvalidRequestError | None:
        """A part of a transaction that failed, or of one abandoned at its timeout (the trainer
        does not know yet: taken alone, its part would be applied as a whole update)."""
        if txn is not None and txn.failure is not None:
            return InvalidRequestError(
                f"update_info: {txn.describe()} already failed ({txn.failure}): "
                "it commits nothing; /start_weight_update again",
                "update_info",
            )
        if txn is None and self.expired is not None:
            return InvalidRequestError(f"update_info: {self.expired}; /start_weight_update again", "update_info")
        return None

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
        txn = self.transaction
        if txn is not None and self.transfer is None and time.monotonic() - txn.touched > self.timeout_s:
            self.abandon(f"no call for {self.timeout_s:.0f}s (its timeout)")
            self.expired = (
                f"weight update transaction {txn.number} was abandoned after {self.timeout_s:.0f}s "
                "without a call (its timeout); nothing of it is served"
            )

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
            version = self._commit(got.version, got.lora)
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

    def _commit(self, version: WeightVersion | None, lora: tuple[str, dict] | None = None, parts: bool = False) -> int:
        """Copy what every rank staged into the model, now (between two steps, so no step
        ever sees a half-updated model), and number the new weights. Without weights worth
        keeping (a level-2 sleep, a dummy start), a transaction's parts must together carry
        every required weight, or nothing is copied (a whole update is checked so on receipt)."""
        refusal = asleep_refusal(self.core)
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
                self._drop_parts()  # a rank that refused must not leave another's staging behind
                raise
            self.core.state.no_weights = False  # every required weight is in place now
        self.commits += 1
        return self.core.new_weight_version(version)

    # -- the transaction -----------------------------------------------------------------------
    def _start(self, call: Call, body: StartWeightUpdate) -> WeightUpdateStarted:
        if not body.is_checkpoint_format:
            raise InvalidRequestError(
                "is_checkpoint_format: rlserve takes weights under their checkpoint "
                "(Hugging Face) names only; send true",
                "is_checkpoint_format",
            )
        if self.transfer is not None:
            raise ConflictError(
                f"start_weight_update: {type(self.transfer.body).__name__} is still under "
                "way; start once it has answered"
            )
        if self.transaction is not None:
            # Never abandoned by another start: that would drop its owner's parts behind its
            # back. Its owner finishes it; its timeout, or a new init, ends it otherwise.
            raise ConflictError(
                f"start_weight_update: {self.transaction.describe()} is still open: finish "
                f"it first (or it is abandoned after {self.timeout_s:.0f}s without a call)"
            )
        refusal = asleep_refusal(self.core)
        if refusal is not None:
            raise refusal
        self._numbers += 1
        self.expired = None
        now = time.monotonic()
        txn_id = body.transaction_id if body.transaction_id is not None else f"txn-{self._numbers}"
        self.transaction = Transaction(self._numbers, now, now, txn_id)
        return WeightUpdateStarted("Weight update started", self._numbers, txn_id)

    def _finish(self, call: Call, body: FinishWeightUpdate) -> WeightUpdateFinished:
        version, txn = body.weight_version, self.transaction
        if txn is None:
            why, self.expired = (f": {self.expired}" if self.expired else ""), None
            raise InvalidRequestError(
                f"finish_weight_update: no weight update is open{why} (POST /start_weight_update first)",
                "weight_version",
            )
        txn.check_owner(body.transaction_id, "transaction_id")
        if self.transfer is not None:
            raise ConflictError(
                f"finish_weight_update: a part of {txn.describe()} is still being "
                "received; finish once its /update_weights has answered"
            )
        self.transaction = None
        if txn.failure is not None:
            self._drop_parts()
            failed = type(txn.failure)
            message = (
                f"finish_weight_update: nothing was committed: a part of weight update "
                f"transaction {txn.number} failed: {txn.failure}"
            )
            raise (failed(message, "update_info") if issubclass(failed, InvalidRequestError) else failed(message))
        if self.core.state.no_weights and not txn.parts:
            raise InvalidRequestError(
                "finish_weight_update: nothing was committed: the weights were dropped "
                "(a level-2 sleep, or a dummy start) and this transaction sent none; "
                "send every weight",
                "update_info",
            )
        t0 = time.perf_counter()
        try:
            new = self._commit(version, parts=True) if txn.parts else self.core.new_weight_version(version)
        except InvalidUpdateError as e:
            raise InvalidUpdateError(f"finish_weight_update: nothing was committed: {e}") from None
        logger.info(
            "weight update transaction %d committed: %d part(s), %.1f MB, version %s",
            txn.number,
            txn.parts,
            txn.num_bytes / 1e6,
            self.core.weight_label,
        )
        return WeightUpdateFinished(
            "Weight update finished",
            self.core.weight_label,
            new,
            txn.parts,
            txn.num_bytes,
            time.perf_counter() - t0,
            txn.id,
        )

    def end(self, why: str) -> None:
        """Abandon the open transaction, and tell its owner at its next part or finish."""
        txn = self.transaction
        if txn is None:
            return
        self.abandon(why)
        self.expired = (
            f"weight update transaction {txn.number} ({txn.id!r}) was abandoned: {why}; nothing of it is served"
        )

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

    # A data-parallel replica that (re)joins copies a healthy replica's weights (and then
    # takes its version): the source sends between two of its steps, so the copy is one
    # version, never half of an update (updates are applied between steps too).
    def _layout(self, call: Call, body: WeightsLayout) -> list[str]:
        return self.core.executor.collective_rpc(rank.WeightsLayout())

    def _copy_to_peer(self, call: Call, body: CopyWeightsToPeer) -> PeerCopied:
        if self.core.state.weights_asleep:  # the copy reads the weights alone: a sleeping KV cache may stay so
            raise ConflictError("copy_weights_to_peer: this replica's weights are asleep")
        self._check_layouts(body.digests)
        version = self.core.weight_version
        sizes = self.core.executor.collective_rpc(rank.CopyPeer(True, body.address, body.ports, None, body.timeout_s))
        return PeerCopied(version, sum(int(x) for x in sizes))

    def _copy_from_peer(self, call: Call, body: CopyWeightsFromPeer) -> PeerCopied:
        if self.core.state.weights_asleep:
            raise ConflictError("copy_weights_from_peer: this replica's weights are asleep")
        self._check_layouts(body.digests)
        sizes = self.core.executor.collective_rpc(rank.CopyPeer(False, body.address, body.ports, None, body.timeout_s))
        self.commits += 1
        self.core.state.no_weights = False
        self.core.new_weight_version(body.weight_version)
        return PeerCopied(body.weight_version, sum(int(x) for x in sizes))

    def _check_layouts(self, digests: list[str]) -> None:
        # Compared rank by rank here; every rank pair then copies at once.
        mine = self.core.executor.collective_rpc(rank.WeightsLayout())
        if mine != list(digests):
            raise InvalidRequestError(
                f"peer weight copy: parameter layouts differ ({mine} here, {list(digests)} at the source)", "replica"
            )
