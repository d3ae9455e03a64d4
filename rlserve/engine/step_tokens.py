"""A step's tokens, the scheduler's second half: once a step is launched its tokens count
as computed (`advance`: a sampling request gets a PLACEHOLDER for its token); once its
tokens are back, `update_from_output` puts them in place, checks stop conditions,
finishes requests and gathers the step's outputs, as vLLM's Scheduler.update_from_output
does. Scheduler (scheduler.py) takes these methods as a mixin: they read and count on its
queues.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, cast

from rlserve.engine.kv_cache import KVCacheManager
from rlserve.engine.request import FinishReason, Request, RequestStatus
from rlserve.sequence import PLACEHOLDER, SchedulerOutput, TokenLogprob
from rlserve.wire.outputs import ITERATION_TOKENS_BUCKETS, EngineCoreOutputs, Finished, Started, StepOut

if TYPE_CHECKING:
    from rlserve.engine.structured_output import GrammarMatcher
    from rlserve.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)


class StepTokens:
    # The Scheduler's (scheduler.py), read and counted here.
    kv: KVCacheManager
    requests: dict[str, Request]
    prompt_tokens_total: int
    generation_tokens_total: int
    iteration_tokens: list[int]
    iteration_tokens_sum: int

    if TYPE_CHECKING:

        def finish(self, req: Request, reason: FinishReason, stop_reason: int | None = None) -> Finished: ...

    def advance(self, sched: SchedulerOutput) -> tuple[list[int], list[Request]]:
        """The scheduled tokens are computed. Each request that samples this step gets a
        PLACEHOLDER for its token, which is not known until the step is collected; the
        placeholders' indexes are returned, in step order, with the requests whose first
        token this is."""
        caching, bs = self.kv.enable_prefix_caching, self.kv.block_size
        placeholders: list[int] = []
        first: list[Request] = []
        for item in sched.scheduled:
            req = cast(Request, item.request)  # what `schedule` scheduled: Requests
            start = req.num_computed_tokens
            end = req.num_computed_tokens = start + item.num_new_tokens
            if start < req.num_prompt_tokens:
                self.prompt_tokens_total += min(end, req.num_prompt_tokens) - start
            if caching and start // bs != end // bs:  # a block filled up
                self.kv.cache_computed_blocks(req)
            token_ids = req.token_ids
            if end == len(token_ids):  # the chunk reached the end: it samples
                placeholders.append(end)
                token_ids.append(PLACEHOLDER)
                if end == req.num_prompt_tokens:
                    first.append(req)
        return placeholders, first

    def update_from_output(
        self,
        result: ModelRunnerOutput,
        prompt_start: dict[str, int],
        placeholders: list[int],
        first: list[Request],
        version: int,
    ) -> EngineCoreOutputs | None:
        """Turn a collected step's tokens into request state and outputs. `prompt_start`:
        where each prompt-logprobs chunk started; `placeholders`, `first`: what `advance`
        returned for the step; `version`: the weights it ran on."""
        now = time.monotonic()  # when these tokens were produced, as far as anyone can see
        for rid, logprobs in result.prompt_logprobs.items():
            req = self.requests.get(rid)
            if req is not None:
                _add_prompt_logprobs(req, prompt_start[rid], logprobs)
        out = StepOut()
        finished = RequestStatus.FINISHED
        bs = self.kv.block_size
        recorded = 0
        produced = self.generation_tokens_total
        prompts = 0  # of requests whose first token this is (vLLM counts them in the step)
        for req in first:
            if req.status is not finished:
                req.first_token_time = now
                prompts += req.num_prompt_tokens
        for item, token, logprob, index in zip(result.sample_requests, result.token_ids, result.logprobs, placeholders):
            req = item.request
            if req.status is finished:  # finished or aborted meanwhile: the token is discarded
                continue
            req.last_token_time = now
            # Most tokens of a non-streamed request only need recording: not a stop token,
            # not its last, and completing no KV block.
            if (
                not req.stream
                and index < req.last_index
                and (index + 1) % bs
                and token not in req.stop_ids
                and req.matcher is None
            ):
                req.token_ids[index] = token
                req.token_versions.append(version)
                if logprob is not None:
                    req.logprobs.append(logprob)
                recorded += 1
                continue
            self._accept(req, token, logprob, version, index, out)
        self.generation_tokens_total += recorded
        produced = self.generation_tokens_total - produced
        if produced:
            self.iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, prompts + produced)] += 1
            self.iteration_tokens_sum += prompts + produced
        return out.build(version, now)

    def _accept(
        self, req: Request, token: int, logprob: TokenLogprob | None, version: int, index: int, out: StepOut
    ) -> None:
        """Record a sampled token in place of its placeholder, decide whether the request
        is done, and report it in `out`: every token of a streamed request, the whole of a
        non-streamed one when it finishes."""
        token_ids = req.token_ids
        token_ids[index] = token
        req.token_versions.append(version)
        if logprob is not None:
            req.logprobs.append(logprob)
        self.generation_tokens_total += 1
        kv = self.kv
        # The token completes a block whose registration waited for it (overlapped
        # scheduling computes a position before its token is known).
        if kv.enable_prefix_caching and (index + 1) % kv.block_size == 0 and req.request_id in kv.blocks:
            kv.cache_computed_blocks(req)
        n_out = index + 1 - req.num_prompt_tokens
        if req.stream:
            out.ids.append(req.request_id)
            out.tokens.append(token)
            out.logprobs.append(logprob)
            out.any_logprobs = out.any_logprobs or logprob is not None
            if n_out == 1:
                p = req.sampling_params
                out.started.append(
                    Started(
                        req.request_id,
                        req.num_cached_tokens,
                        req.prompt_logprobs if p.prompt_logprobs is not None else None,
                    )
                )
        finish, stop_reason = None, None
        if req.matcher is not None and not _advance_grammar(req, req.matcher, token):
            finish = FinishReason.STOP  # the grammar is complete (or could not go on)
        elif token in req.stop_ids and n_out >= req.sampling_params.min_tokens:
            finish = FinishReason.STOP
            if req.sampling_params.ignore_eos or token not in req.eos_token_ids:
                stop_reason = token  # a stop_token_ids hit, not end-of-sequence
        elif n_out >= req.max_output_tokens:
            finish = FinishReason.LENGTH
        if finish is not None:
            del token_ids[index + 1 :]  # a token the next step sampled is discarded
            out.finished.append(self.finish(req, finish, stop_reason))


def _add_prompt_logprobs(req: Request, start: int, logprobs: list[TokenLogprob]) -> None:
    if not req.prompt_logprobs:
        req.prompt_logprobs = [None]
    if len(req.prompt_logprobs) == start + 1:  # skip recomputed chunks
        req.prompt_logprobs.extend(logprobs)


def _advance_grammar(req: Request, matcher: GrammarMatcher, token: int) -> bool:
    """Feed the token to the request's grammar; False once the grammar is done."""
    if not matcher.accept([token]):
        # Sampled under its mask, a token is always accepted; say so if not.
        logger.warning("request %s: token %d broke its grammar; the request ends here", req.request_id, token)
        return False
    return not matcher.is_terminated()
