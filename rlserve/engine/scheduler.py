"""Continuous batching with one token budget per step.

Each step, running requests go first (a decode is one token, an unfinished prefill takes
the next chunk), then waiting requests are admitted while budget, sequence slots and KV
blocks last. When blocks run out, the most recently admitted running request is preempted:
its blocks are freed and it is recomputed later from its prompt and the tokens it had.
A request with a LoRA adapter is admitted once its adapter has a slot (engine/lora.py);
while every slot is in use by other adapters' requests it is passed over, and waits.

What happens to a step's tokens once it is launched and collected (`advance`,
`update_from_output`) is step_tokens.py's.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from rlserve.engine.kv_cache import KVCacheManager
from rlserve.engine.request import FinishReason, Request, RequestStatus
from rlserve.engine.state import EngineState
from rlserve.engine.step_tokens import StepTokens
from rlserve.sampling_params import InvalidRequestError
from rlserve.sequence import ScheduledRequest, SchedulerOutput
from rlserve.wire.outputs import (
    ITERATION_TOKENS_BUCKETS,
    FinalTokens,
    Finished,
    RequestTiming,
    RoutedExperts,
    version_spans,
)

if TYPE_CHECKING:
    from rlserve.engine.lora import LoRAManager


class Scheduler(StepTokens):
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        state: EngineState,
        lora: LoRAManager | None = None,
    ) -> None:
        self.kv = kv
        self.state = state  # the engine's: paused, asleep, without weights (read here, never set)
        self.lora = lora  # the slots adapters take
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.finished_ids: list[str] = []  # finished since the last step that ran
        self.num_deferred = 0  # waiting requests the last schedule passed over for a LoRA slot
        # Requests whose adapter could not be brought back (engine/lora.py), with why: the
        # engine ends them
        self.refused: list[tuple[Request, InvalidRequestError]] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # vllm:iteration_tokens_total, kept here: most steps send the front end nothing
        self.iteration_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0

    # -- queue management -------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, reason: FinishReason, stop_reason: int | None = None) -> Finished:
        """End a request (queued, running, or not yet in the queue): set its status, remove
        it, free its blocks and its adapter's slot."""
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.requests.pop(req.request_id, None)
        self.finished_ids.append(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        routes = None
        if self.kv.routes is not None and req.sampling_params.return_routed_experts is not False:
            rows = self.kv.routes_of(req)  # before its blocks go back
            routes = None if rows is None else RoutedExperts.pack(rows)
        self.kv.free(req)
        if req.lora_slot >= 0:
            self._adapters().release(req)
        return Finished(
            req.request_id,
            reason.value,
            stop_reason,
            None if req.stream else _final(req),
            request_timing(req, time.monotonic()),
            routes,
        )

    def drop_kv(self, req: Request) -> None:
        """Forget a request's KV so it is recomputed (keep-mode pause with clear_cache)."""
        self._preempt(req, count=False)
        self.running.remove(req)
        self.waiting.appendleft(req)

    @property
    def stopped(self) -> bool:
        return self.state.stopped

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- the step ----------------------------------------------------------------------
    def _preempt(self, req: Request, count: bool = True) -> None:
        self.kv.free(req)
        if req.lora_slot >= 0:  # its adapter's slot may go to another while it waits
            self._adapters().release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        if count:
            req.num_preemptions += 1
            self.num_preemptions += 1

    def _waiting_on_sibling(self, req: Request) -> bool:
        """n > 1: samples after the first wait until it has computed the shared prompt, then
        take its blocks from the prefix cache instead of computing them again."""
        if req.group_id is None or req.sample_index == 0 or req.num_computed_tokens:
            return False
        if not self.kv.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return False
        leader = self.requests.get(f"{req.group_id}-0")
        return leader is not None and leader.num_computed_tokens < leader.num_prompt_tokens

    def _adapters(self) -> LoRAManager:
        assert self.lora is not None  # a request takes a slot only where the engine has them
        return self.lora

    def _lora_slot(self, req: Request) -> bool:
        """Give the first waiting request its adapter's slot. False if none is free, or if
        its adapter cannot be had: then it leaves the queue, for the engine to end."""
        try:
            return self._adapters().acquire(req)
        except InvalidRequestError as e:
            self.refused.append((self.waiting.popleft(), e))
            return False

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Blocks for `n` more tokens of running `req`, preempting the most recently
        admitted requests until they fit; False when `req` itself had to go."""
        while not self.kv.allocate(req, n):
            victim = self.running.pop()
            self._preempt(victim)
            self.waiting.appendleft(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.stopped:
            return out
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        self.num_deferred = 0
        if not out.preempted:  # admitting new work right after a preemption would only thrash
            budget = self._admit_waiting(out, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if self.kv.state_cache is not None:
            out.state_loads, out.state_saves = self.kv.take_state_copies()
        if out.scheduled and self.finished_ids:  # told with the next step that runs
            out.finished_ids, self.finished_ids = self.finished_ids, []
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests first: a decode is one token, an unfinished prefill its next
        chunk. Returns the budget left."""
        # This loop runs for every running request every step: kept lean.
        running, scheduled = self.running, out.scheduled
        states = self.kv.state_cache is not None  # a hybrid model's prompt chunks end at its save point
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_tokens = len(req.token_ids)
            if num_tokens - req.num_prompt_tokens >= req.max_output_tokens:
                i += 1  # its last token is still being sampled, and it is the last one
                continue
            n = num_tokens - req.num_computed_tokens
            if n > budget:
                n = budget
            prompt = states and req.num_computed_tokens < req.num_prompt_tokens
            if prompt:
                n = self.kv.state_chunk(req, req.num_computed_tokens, n)
            # Most steps a request's blocks still have room: no call into the KV manager.
            if req.num_computed_tokens + n > req.kv_capacity and not self._allocate_or_preempt(req, n, out):
                continue  # `req` itself was preempted
            if prompt:
                self.kv.save_state(req, req.num_computed_tokens, n)
            scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Waiting requests, in order, while budget, sequence slots and KV blocks last.
        Returns the budget left."""
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self._waiting_on_sibling(req):
                skipped.append(self.waiting.popleft())
                continue
            if req.lora_name is not None and req.lora_slot < 0 and not self._lora_slot(req):
                if self.waiting and self.waiting[0] is req:  # no slot free: it waits
                    skipped.append(self.waiting.popleft())
                    self.num_deferred += 1
                continue
            cached: list[int] = []
            if req.num_computed_tokens == 0:
                cached = self.kv.find_cached_prefix(req)
                self.prefix_cache_queries += req.num_tokens
            num_computed = len(cached) * self.kv.block_size
            n = min(req.num_tokens - num_computed, budget)
            if self.kv.state_cache is not None:
                n = self.kv.state_chunk(req, num_computed, n)
            if not self.kv.allocate(req, n, cached):
                break
            if self.kv.state_cache is not None:
                self.kv.save_state(req, num_computed, n)
            self.waiting.popleft()
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens == 0:
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            if not req.scheduled_time:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget


def _final(req: Request) -> FinalTokens:
    """Everything a non-streamed request produced."""
    n = len(req.token_versions)  # tokens read back; not one still in flight
    start = req.num_prompt_tokens
    p = req.sampling_params
    return FinalTokens(
        req.token_ids[start : start + n],
        list(req.logprobs) if p.logprobs is not None else None,
        [(s.version, s.start, s.end) for s in version_spans(req.token_versions)],
        req.num_cached_tokens,
        req.prompt_logprobs if n and p.prompt_logprobs is not None else None,
    )


def request_timing(req: Request, now: float) -> RequestTiming:
    """vLLM's phases of a request that ends now; those it never reached take no time."""
    arrived, scheduled, first, last = req.arrival_time, req.scheduled_time, req.first_token_time, req.last_token_time
    n = req.num_preemptions
    if not scheduled:  # ended in the queue
        return RequestTiming(now - arrived, 0.0, 0.0, 0.0, -1.0, n)
    if not first:  # ended before its first token
        return RequestTiming(scheduled - arrived, now - scheduled, 0.0, now - scheduled, -1.0, n)
    return RequestTiming(scheduled - arrived, first - scheduled, last - first, last - scheduled, now - first, n)
