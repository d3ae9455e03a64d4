"""The requests in flight on the data-parallel replicas, as the front end accounts for them
(dp_client.py routes them): which replica runs each, which of its samples are still
running, and how many tokens it still owes the router's load (dp_router.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlserve.frontend.dp_router import Router
from rlserve.sampling_params import SamplingParams
from rlserve.wire.outputs import EngineCoreOutputs
from rlserve.wire.validation import sample_ids


@dataclass
class TrackedRequest:
    """A request in flight on a replica, as the front end accounts for it."""

    request_id: str
    replica: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    cache_salt: str | None
    hashes: list[int]
    owed: int  # tokens the replica still owes the router's accounting
    samples: set[str] = field(default_factory=set)
    produced: int = 0
    retried: bool = False


class InFlightRequests:
    """Every tracked request, by id and by sample id; what they owe is paid to the router."""

    def __init__(self, router: Router):
        self.router = router
        self.tracked: dict[str, TrackedRequest] = {}
        self.by_sample: dict[str, TrackedRequest] = {}

    def sent(self, t: TrackedRequest) -> None:
        """`t` has just been sent to its replica: its load counts there from now on."""
        self.router.sent(t.replica, t.hashes, t.owed)
        self.tracked[t.request_id] = t
        for sid in t.samples:
            self.by_sample[sid] = t

    def on_replica(self, index: int) -> list[TrackedRequest]:
        return [t for t in self.tracked.values() if t.replica == index]

    def pay(self, t: TrackedRequest, tokens: int) -> None:
        if t.produced == 0 and tokens:  # the prompt is computed once the first token is out
            tokens += len(t.prompt_token_ids)
        t.produced += tokens
        tokens = min(tokens, t.owed)
        t.owed -= tokens
        self.router.done(t.replica, tokens)

    def forget(self, t: TrackedRequest) -> None:
        self.router.done(t.replica, t.owed)
        t.owed = 0
        self.tracked.pop(t.request_id, None)
        for sid in sample_ids(t.request_id, t.params.n):
            self.by_sample.pop(sid, None)

    def account(self, out: EngineCoreOutputs) -> None:
        """A step's tokens, finished samples and rejected requests, paid and forgotten."""
        by_sample = self.by_sample
        for sid in out.request_ids:
            t = by_sample.get(sid)
            if t is not None:
                self.pay(t, 1)
        for f in out.finished:
            t = by_sample.get(f.request_id)
            if t is None:
                continue
            if f.final is not None:
                self.pay(t, len(f.final.token_ids))
            t.samples.discard(f.request_id)
            if not t.samples:
                self.forget(t)
        for rej in out.rejected:
            t = self.tracked.get(rej.request_id)
            if t is not None:
                self.forget(t)
