"""A weight update in parts (/start_weight_update ... /finish_weight_update): its owner's
id, what it staged, and the first part that failed; and `Transactions`, which opens,
commits and abandons it for the engine's one owner of updates (weight_updates.py).

At most one transaction is open. It has an owner: /start_weight_update names it
(`transaction_id`, given or made), and a part or finish that carries another id is a 409,
as is a second start while one is open; a vLLM client that sends no id gets the one
transaction open, as in vLLM. A transaction commits all of its parts or none.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

from rlserve.engine.state import asleep_refusal
from rlserve.errors import ConflictError, PayloadTooLargeError
from rlserve.sampling_params import InvalidRequestError
from rlserve.weight_transfer.errors import InvalidUpdateError
from rlserve.weight_transfer.info import UpdateInfo
from rlserve.wire.control import WeightUpdateFinished, WeightUpdateStarted
from rlserve.wire.messages import Call, FinishWeightUpdate, StartWeightUpdate
from rlserve.wire.weight_version import WeightVersion

logger = logging.getLogger(__name__)


@dataclass
class Transaction:
    """An update in parts: /start_weight_update ... /finish_weight_update."""

    number: int
    opened: float
    touched: float  # the last call of it: its timeout counts from there
    id: str = ""  # its owner's name for it: parts and finish that carry an id must carry this one
    parts: int = 0
    num_bytes: int = 0
    num_elements: int = 0  # staged and announced: bounded by the model's size
    failure: BaseException | None = None  # the first part that failed: finish commits nothing

    def describe(self) -> str:
        return (
            f"weight update transaction {self.number} (transaction_id {self.id!r}, opened "
            f"{time.monotonic() - self.opened:.0f}s ago, {self.parts} part(s) staged)"
        )

    def check_owner(self, transaction_id: str | None, what: str) -> None:
        if transaction_id is not None and transaction_id != self.id:
            raise ConflictError(
                f"{what}: transaction_id {transaction_id!r:.80} is not the open one: "
                f"{self.describe()} is open; it is left as it was"
            )


class Updates(Protocol):
    """What the transactions need of the engine's owner of updates (weight_updates.py)."""

    core: Any
    transfer: Call | None  # the init or receive under way, if any

    def commit(
        self, version: WeightVersion | None, lora: tuple[str, dict] | None = None, parts: bool = False
    ) -> int: ...

    def drop_parts(self) -> None: ...


class Transactions:
    """The open transaction, if any, and why the last one ended unasked (its timeout, a new
    init, a sleep): its owner hears that at its next part or finish."""

    def __init__(self, updates: Updates, timeout_s: float) -> None:
        self.updates = updates
        self.timeout_s = timeout_s  # an open transaction left alone this long is abandoned
        self.open: Transaction | None = None
        self.expired: str | None = None  # why the last transaction ended unasked, until the next start
        self._numbers = 0

    def start(self, call: Call, body: StartWeightUpdate) -> WeightUpdateStarted:
        if not body.is_checkpoint_format:
            raise InvalidRequestError(
                "is_checkpoint_format: rlserve takes weights under their checkpoint "
                "(Hugging Face) names only; send true",
                "is_checkpoint_format",
            )
        if self.updates.transfer is not None:
            raise ConflictError(
                f"start_weight_update: {type(self.updates.transfer.body).__name__} is still under "
                "way; start once it has answered"
            )
        if self.open is not None:
            # Never abandoned by another start: that would drop its owner's parts behind its
            # back. Its owner finishes it; its timeout, or a new init, ends it otherwise.
            raise ConflictError(
                f"start_weight_update: {self.open.describe()} is still open: finish "
                f"it first (or it is abandoned after {self.timeout_s:.0f}s without a call)"
            )
        refusal = asleep_refusal(self.updates.core.state)
        if refusal is not None:
            raise refusal
        self._numbers += 1
        self.expired = None
        now = time.monotonic()
        txn_id = body.transaction_id if body.transaction_id is not None else f"txn-{self._numbers}"
        self.open = Transaction(self._numbers, now, now, txn_id)
        return WeightUpdateStarted("Weight update started", self._numbers, txn_id)

    def finish(self, call: Call, body: FinishWeightUpdate) -> WeightUpdateFinished:
        version, txn, core = body.weight_version, self.open, self.updates.core
        if txn is None:
            why, self.expired = (f": {self.expired}" if self.expired else ""), None
            raise InvalidRequestError(
                f"finish_weight_update: no weight update is open{why} (POST /start_weight_update first)",
                "weight_version",
            )
        txn.check_owner(body.transaction_id, "transaction_id")
        if self.updates.transfer is not None:
            raise ConflictError(
                f"finish_weight_update: a part of {txn.describe()} is still being "
                "received; finish once its /update_weights has answered"
            )
        self.open = None
        if txn.failure is not None:
            self.updates.drop_parts()
            failed = type(txn.failure)
            message = (
                f"finish_weight_update: nothing was committed: a part of weight update "
                f"transaction {txn.number} failed: {txn.failure}"
            )
            raise (failed(message, "update_info") if issubclass(failed, InvalidRequestError) else failed(message))
        if core.state.no_weights and not txn.parts:
            raise InvalidRequestError(
                "finish_weight_update: nothing was committed: the weights were dropped "
                "(a level-2 sleep, or a dummy start) and this transaction sent none; "
                "send every weight",
                "update_info",
            )
        t0 = time.perf_counter()
        try:
            new = self.updates.commit(version, parts=True) if txn.parts else core.new_weight_version(version)
        except InvalidUpdateError as e:
            raise InvalidUpdateError(f"finish_weight_update: nothing was committed: {e}") from None
        logger.info(
            "weight update transaction %d committed: %d part(s), %.1f MB, version %s",
            txn.number,
            txn.parts,
            txn.num_bytes / 1e6,
            core.weight_label,
        )
        return WeightUpdateFinished(
            "Weight update finished",
            core.weight_label,
            new,
            txn.parts,
            txn.num_bytes,
            time.perf_counter() - t0,
            txn.id,
        )

    def refusal(self, txn: Transaction | None) -> InvalidRequestError | None:
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

    def staging_refusal(self, txn: Transaction, update_info: UpdateInfo | None) -> InvalidRequestError | None:
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
        return sum(math.prod(e.shape) for e in self.updates.core.executor.expected_weights.values())

    def expire_idle(self) -> None:
        """Abandon the open transaction once it has been left alone past its timeout."""
        txn = self.open
        if txn is not None and self.updates.transfer is None and time.monotonic() - txn.touched > self.timeout_s:
            self.abandon(f"no call for {self.timeout_s:.0f}s (its timeout)")
            self.expired = (
                f"weight update transaction {txn.number} was abandoned after {self.timeout_s:.0f}s "
                "without a call (its timeout); nothing of it is served"
            )

    def end(self, why: str) -> None:
        """Abandon the open transaction, and tell its owner at its next part or finish."""
        txn = self.open
        if txn is None:
            return
        self.abandon(why)
        self.expired = (
            f"weight update transaction {txn.number} ({txn.id!r}) was abandoned: {why}; nothing of it is served"
        )

    def abandon(self, why: str) -> None:
        """Close the open transaction without committing it."""
        txn, self.open = self.open, None
        if txn is None:
            return
        logger.warning("%s abandoned: %s; nothing of it is served", txn.describe(), why)
        self.updates.drop_parts()
