"""The control handshake of one update between the trainer and each receiving rank.

Updates pair up turn by turn, per receiving rank: the trainer's k-th push to rank r with
rank r's k-th /update_weights. Each turn ends either paired (both sides acted on it) or
void (one side gave up waiting and said so with a compare-and-set, so exactly one of the
two writes wins), and both sides step past it alike: a refused request, a no-show or a
timeout never leaves the two counters apart, and the next push pairs with the next request.

Turn t of rank r, keys in the group's store:

0. trainer  -> plans/{digest}     the plan itself (packing.plan_json), once per group and plan:
   a trainer sends the same tensor list every step, and the receivers read it only to say
   how their update_info differs from it
1. trainer  -> r{r}/t{t}/plan     {"digest", "checksum"} or {"cancel": message}
   receiver -> r{r}/t{t}/plan     "void" when no plan came while it waited
2. receiver -> r{r}/t{t}/verdict  {"ok": true} | {"ok": false, "error": message}
   trainer  -> r{r}/t{t}/verdict  "void" when no verdict came within timeout_s
3. trainer  -> r{r}/t{t}/go       {"ok": bool, "error": message, "refused": bool}, once
   every rank answered, so a rank that said ok does not wait for bytes another refused
4. the buckets, then one int64 checksum per bucket, on the data plane.
5. receiver -> r{r}/t{t}/done     "ok" once every bucket arrived and matched its checksum
   (or it read a go that says no); the trainer's push returns only then (a receiver that
   fails writes its error there), so the trainer hears of a damaged bucket too, and never
   leaves (taking the store it hosts along) while a receiver still reads the go.

A receiver that refuses (bad update_info, a plan that does not match it, or a refusal
the server made before the handshake: asleep, a bad weight_version) still waits up to
REFUSAL_GRACE_S for the trainer's plan, so a trainer that is sending hears the reason at
once; with no trainer it voids the turn. A trainer that fails before sending (its
iterator raised, tensors on the wrong device) posts a cancel the same way, so the
server's pending /update_weights answers at once. Any message that does not parse is
named in the error: a malformed plan is a refusal (nothing moved), a malformed go breaks
the group (the receiver cannot tell whether bytes follow).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .errors import InvalidUpdateError, UpdateRefusedError, WeightTransferError
from .group import TransferGroup
from .store_keys import BROKEN, VOID, key

REFUSAL_GRACE_S = 2.0  # how long a refusal waits for a trainer to tell
GO_MARGIN_S = 2.0


PLAN_WAIT_S = 2.0  # how long a receiver waits for a plan it was told is in the store


class TrainerPlan(NamedTuple):
    digest: str
    checksum: bool
    turn: int = -1  # the receiver's turn it was agreed in (for `report_done`)


def plan_key(digest: str) -> str:
    return f"plans/{digest}"


def post_plan(group: TransferGroup, digest: str, plan: Callable[[], Mapping[str, Any]]) -> None:
    """Trainer: put the plan with this digest in the store, unless it is there already."""
    if digest not in group.posted_plans:
        group.set(plan_key(digest), json.dumps(plan()))
        group.posted_plans.add(digest)


def fetch_plan(group: TransferGroup, digest: str) -> Mapping[str, Any] | None:
    """Receiver: the trainer's plan with this digest, or None if it cannot be read."""
    text = group.await_key(plan_key(digest), min(PLAN_WAIT_S, group.timeout_s), "the trainer's plan")
    try:
        plan = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return plan if isinstance(plan, dict) else None


def _parse_plan(text: str) -> TrainerPlan | str:
    """The trainer's plan message, or why it is not one (a cancel's message included)."""
    try:
        msg = json.loads(text)
    except ValueError as e:
        return f"the trainer's plan message is not JSON ({e}): {text[:80]!r}"
    if not isinstance(msg, dict):
        return f"the trainer's plan message must be a JSON object, got {type(msg).__name__}"
    if "cancel" in msg:
        return f"the trainer cancelled this update before sending anything: {msg['cancel']}"
    digest, checksum = msg.get("digest"), msg.get("checksum", False)
    problems = []
    if not isinstance(digest, str):
        problems.append(f"digest must be a string, got {digest!r}"[:120])
    if not isinstance(checksum, bool):
        problems.append(f"checksum must be true or false, got {checksum!r}"[:120])
    if problems:
        return "the trainer's plan message is malformed: " + "; ".join(problems)
    assert isinstance(digest, str)  # checked above
    return TrainerPlan(digest, checksum)


def receiver_handshake(group: TransferGroup, refusal: str | None,
                       judge: Callable[[TrainerPlan], str | None]) -> TrainerPlan:
    """Pair this request with the trainer's next push and agree on it.

    Returns the trainer's plan once every rank said ok (the bytes follow). Raises
    InvalidUpdateError when refused (by `refusal`, by `judge`, by another rank or by the
    trainer; nothing moved, the group stays usable), WeightTransferError when no trainer
    came (group still usable) or the group broke.
    """
    wait_s = min(REFUSAL_GRACE_S, group.timeout_s) if refusal else group.timeout_s
    deadline = time.monotonic() + wait_s
    r = group.rank
    while True:
        turn = group.turn
        plan_key = key(r, turn, "plan")
        text = group.await_key(plan_key, deadline - time.monotonic(),
                               "the trainer's plan (is trainer_send_weights running?)")
        if text is None:
            text = group.cas(plan_key, VOID)
            if text == VOID:  # nobody came: the turn is void on both sides
                group.turn += 1
                if refusal:
                    raise InvalidUpdateError(refusal)
                raise WeightTransferError(
                    f"the trainer's plan did not arrive within {wait_s:g}s (is trainer_send_weights running? "
                    f"rank {r}/{group.world_size} at {group.master}); nothing changed and the group is still usable")
        if text.startswith(BROKEN):
            raise group.fail(f"the trainer: {text[len(BROKEN):]}")
        plan = _parse_plan(text)
        problem = refusal or (plan if isinstance(plan, str) else judge(plan))
        answer = json.dumps({"ok": problem is None, "error": problem})
        got = group.cas(key(r, turn, "verdict"), answer)
        group.turn += 1
        if got == answer:
            break
        if got.startswith(BROKEN):
            raise group.fail(f"the trainer: {got[len(BROKEN):]}")
        if got != VOID:
            raise group.fail(f"unexpected value at {key(r, turn, 'verdict')}: {got[:80]!r}")
        # The trainer gave up on that turn before we answered: pair with its next one.
    if problem is not None:
        raise InvalidUpdateError(problem)
    _await_go(group, turn)
    assert isinstance(plan, TrainerPlan)
    return plan._replace(turn=turn)


def _await_go(group: TransferGroup, turn: int) -> None:
    """Wait for the trainer's go-ahead on an agreed turn; raise if it calls the push off."""
    # The trainer gives every rank up to timeout_s (from its offer, before our verdict) to
    # answer, then says go either way: a little longer here covers its last steps.
    go_wait = group.timeout_s + GO_MARGIN_S
    text = group.await_key(key(group.rank, turn, "go"), go_wait, "the trainer's go-ahead")
    if text is None:
        raise group.fail(f"no go-ahead from the trainer within {go_wait:g}s")
    try:
        go = json.loads(text)
        ok, error = go["ok"], go.get("error")
        if not isinstance(ok, bool):
            raise TypeError(f"ok must be true or false, got {ok!r}")
    except (ValueError, TypeError, KeyError) as e:
        raise group.fail(f"the trainer's go message is malformed ({type(e).__name__}: {e}): "
                          f"{text[:80]!r}") from e
    if not ok:
        report_done(group, turn)  # read: the trainer may go (and take its store along)
        if go.get("refused", True):
            raise InvalidUpdateError(str(error or "refused by another receiving rank"))
        raise WeightTransferError(f"{error}; nothing changed and the group is still usable")


def report_done(group: TransferGroup, turn: int) -> None:
    """Every bucket of `turn` arrived and matched: the trainer's push may return."""
    group.set(key(group.rank, turn, "done"), "ok")


def refuse(group: TransferGroup, message: str) -> None:
    """Take this rank's turn and refuse it, so a trainer that is sending is told at once.

    For refusals the server makes before looking at the transfer (asleep, a bad
    weight_version); `receive_weights` does it for every refusal it finds itself.
    """
    try:
        receiver_handshake(group, message, lambda plan: None)
    except InvalidUpdateError:
        pass


def _offer(group: TransferGroup, rank: int, text: str) -> None:
    """Post the plan at rank's turn, stepping past turns the receiver voided."""
    while True:
        plan_key = key(rank, group.turns[rank], "plan")
        got = group.cas(plan_key, text)
        if got == text:
            return
        if got == VOID:
            group.turns[rank] += 1
            continue
        if got.startswith(BROKEN):
            raise group.fail(f"receiver rank {rank}: {got[len(BROKEN):]}")
        raise group.fail(f"unexpected value at {plan_key}: {got[:80]!r}")


def trainer_handshake(group: TransferGroup, message: Mapping[str, Any], wait_s: float | None = None
                      ) -> dict[int, int]:
    """Offer `message` to every receiving rank and collect their verdicts; then say go.
    Returns each rank's turn, for `await_done`. (Only ranks that said ok wait for the go.)

    Raises UpdateRefusedError with the receivers' messages when any refused, and
    WeightTransferError when one did not answer; the group stays usable in both cases.
    A cancel (`{"cancel": ...}`) waits only `wait_s` and says no go (receivers stop on it).
    """
    group.check_usable()
    text = json.dumps(message)
    for r in group.turns:
        _offer(group, r, text)
    wait_s = group.timeout_s if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    errors: list[str] = []
    refused = True
    answered: dict[int, int] = {}
    for r in list(group.turns):
        turn = group.turns[r]
        verdict_key = key(r, turn, "verdict")
        got = group.await_key(verdict_key, deadline - time.monotonic(),
                              f"the verdict of receiver rank {r} (is its /update_weights call running?)")
        if got is None:
            got = group.cas(verdict_key, VOID)
        group.turns[r] += 1
        _forget(group, r, turn)
        if got == VOID:
            errors.append(f"the verdict of receiver rank {r} did not arrive within {wait_s:g}s (is its "
                          "/update_weights call running?); nothing changed and the group is still usable")
            refused = False
            continue
        if got.startswith(BROKEN):
            raise group.fail(f"receiver rank {r}: {got[len(BROKEN):]}")
        try:
            verdict = json.loads(got)
            ok = verdict["ok"]
        except (ValueError, TypeError, KeyError) as e:
            raise group.fail(f"receiver rank {r} sent a malformed verdict: {got[:80]!r}") from e
        if ok:
            answered[r] = turn
        elif str(verdict.get("error")) not in errors:
            errors.append(str(verdict.get("error")))
    if "cancel" in message:
        return answered
    go = json.dumps({"ok": not errors, "error": "; ".join(errors) or None, "refused": refused})
    for r, turn in answered.items():
        group.set(key(r, turn, "go"), go)
    if errors:
        await_done(group, answered)  # the ranks that said ok have read the no
        raise (UpdateRefusedError if refused else WeightTransferError)("; ".join(errors))
    return answered


def await_done(group: TransferGroup, turns: Mapping[int, int]) -> None:
    """Wait until every rank confirmed its buckets (a rank that failed says why)."""
    for r, turn in turns.items():
        got = group.await_key(key(r, turn, "done"), group.timeout_s, f"receiver rank {r}'s confirmation")
        if got != "ok":
            raise group.fail(f"receiver rank {r} did not confirm the update within {group.timeout_s:g}s"
                             if got is None else f"receiver rank {r} answered {got[:80]!r} for its confirmation")


def cancel(group: TransferGroup, message: str) -> None:
    """Tell every receiver that this push will not happen (best effort, at most the grace)."""
    try:
        trainer_handshake(group, {"cancel": message}, min(REFUSAL_GRACE_S, group.timeout_s))
    except WeightTransferError:
        pass


def _forget(group: TransferGroup, rank: int, turn: int) -> None:
    """Drop the keys of the turns before `turn`: rank answered `turn`, so it is done with them."""
    for t in range(group.forgotten.get(rank, 0), turn):
        for what in ("plan", "verdict", "go", "done"):
            group.delete(key(rank, t, what))
    group.forgotten[rank] = max(group.forgotten.get(rank, 0), turn)
