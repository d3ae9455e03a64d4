"""A weight update in parts (/start_weight_update ... /finish_weight_update), as the
engine's one owner of updates (weight_updates.py) keeps it: its owner's id, what it staged,
and the first part that failed."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlserve.errors import ConflictError


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
