"""The control plane's keys in the group's TCPStore, and the failure markers written into
them (group.py holds the store; handshake.py takes its turns on these keys).

Turn t of rank r is `r{r}/t{t}/{plan|verdict|go|done}`. A side that gives up on a turn
writes VOID there; a side whose group broke writes BROKEN + why into the keys its peers
wait on next, so they fail at once instead of at their timeout. A receiver also writes its
failure into RECEIVER_FAILURE_KEY, which the trainer watches in all its waits: the trainer
may be waiting on another rank (one that will never answer) when it fails.
"""

from __future__ import annotations

import time

import torch.distributed as dist

VOID = "void"  # a turn one side gave up on (handshake.py)
BROKEN = "broken:"  # prefix of a value that says the writer's group failed
RECEIVER_FAILURE_KEY = "broken/receiver"  # the first receiver's failure: the trainer watches it
POLL_S = 0.2  # how often a long wait looks at the store for a peer's failure


def broken_key(rank: int) -> str:
    return f"broken/{rank}"


def key(rank: int, turn: int, what: str) -> str:
    return f"r{rank}/t{turn}/{what}"


def poll_key(store: dist.Store, key: str, deadline: float) -> str | None:
    """Trainer: the key's value, None at the deadline, or (as a BROKEN value) the first
    receiver's failure if it comes first: a store wait would see only the one key."""
    pause = 0.0005  # a verdict or confirmation on its way comes within milliseconds
    while not store.check([key]):
        if store.check([RECEIVER_FAILURE_KEY]):
            return BROKEN + store.get(RECEIVER_FAILURE_KEY).decode(errors="replace")
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(pause, left))
        pause = min(2 * pause, POLL_S / 4)
    return store.get(key).decode(errors="replace")


def store_lost(master: str, e: Exception) -> str:
    """What a failed store call means to the caller."""
    if isinstance(e, dist.DistNetworkError):
        # The store's host closed its group: an end of stream or, with bytes in flight,
        # a reset; both mean the same to the caller.
        return f"the group's store at {master} closed the connection ({e})"
    return f"the group's store at {master} is gone: {e}"


def tell_peers(store: dist.Store, rank: int, turn: int, turns: dict[int, int], value: str) -> None:
    """Write `value` (a failure) into the keys this rank's peers wait on next, so they stop
    waiting at once: the trainer (rank 0, its next `turns` per rank) writes each rank's next
    plan (and a pending go), a receiver its next verdict. Turns the peer has voided are
    stepped over."""
    def first_open(rank: int, turn: int, what: str) -> None:
        for t in range(turn, turn + 64):
            if store.compare_set(key(rank, t, what), "", value).decode(errors="replace") != VOID:
                return

    if rank == 0:
        for r, t in turns.items():
            first_open(r, t, "plan")
            store.compare_set(key(r, t - 1, "go"), "", value)
    else:
        store.compare_set(key(rank, turn - 1, "done"), "", value)
        first_open(rank, turn, "verdict")
