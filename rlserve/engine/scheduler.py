"""Continuous batching with one token budget per step.

Each step, running requests go first (a decode is one token, an unfinished prefill takes
the next chunk), then waiting requests are admitted while budget, sequence slots and KV
blocks last. When blocks run out, the most recently admitted running request is preempted:
its blocks are freed and it is recomputed later from its prompt and the tokens it had.
A request with a LoRA adapter is admitted once its adapter has a slot (engine/lora.py);
while every slot is in use by other adapters' requests it is passed over, and waits.
"""

from __future__ import annotations

import time
from collections import deque

from rlserve.engine.kv_cache import KVCacheManager
from rlserve.engine.request import Request, RequestStatus
from rlserve.sampling_params import InvalidRequestError
from rlserve.sequence import ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, lora=None):
        self.kv = kv
        self.lora = lora  # rlserve.engine.lora.LoRAManager: the slots adapters take
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Requests held in place by a `keep` pause: they keep their KV but are not stepped.
        self.frozen = False
        self.sleeping = False  # the device memory is given back: nothing can run
        self.no_weights = False  # dropped by a level-2 sleep: nothing runs until an update
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.finished_ids: list[str] = []  # finished since the last step that ran
        self.num_deferred = 0  # waiting requests the last schedule passed over for a LoRA slot
        # Requests whose adapter could not be brought back (engine/lora.py), with why: the
        # engine ends them
        self.refused: list[tuple[Request, InvalidRequestError]] = []

    # -- queue management -------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Remove a finished request and free its blocks (its status is already set)."""
        self.requests.pop(req.request_id, None)
        self.finished_ids.append(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        if req.lora_slot >= 0:
            self.lora.release(req)

    def drop_kv(self, req: Request) -> None:
        """Forget a request's KV so it is recomputed (keep-mode pause with clear_cache)."""
        self._preempt(req, count=False)
        self.running.remove(req)
        self.waiting.appendleft(req)

    @property
    def stopped(self) -> bool:
        return self.frozen or self.sleeping or self.no_weights

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- the step ----------------------------------------------------------------------
    def _preempt(self, req: Request, count: bool = True) -> None:
        self.kv.free(req)
        if req.lora_slot >= 0:  # its adapter's slot may go to another while it waits
            self.lora.release(req)
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

    def _lora_slot(self, req: Request) -> bool:
        """Give the first waiting request its adapter's slot. False if none is free, or if
        its adapter cannot be had: then it leaves the queue, for the engine to end."""
        try:
            return self.lora.acquire(req)
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
        budget = self.max_num_batched_tokens

        # The loop below runs for every running request every step: kept lean.
        running, scheduled = self.running, out.scheduled
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
            # Most steps a request's blocks still have room: no call into the KV manager.
            if req.num_computed_tokens + n > req.kv_capacity and not self._allocate_or_preempt(req, n, out):
                continue  # `req` itself was preempted
            scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        preempted = bool(out.preempted)

        # Admitting new work right after a preemption would only thrash.
        skipped: list[Request] = []
        self.num_deferred = 0
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
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
            if not self.kv.allocate(req, n, cached):
                break
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

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if scheduled and self.finished_ids:  # told with the next step that runs
            out.finished_ids, self.finished_ids = self.finished_ids, []
        return out
