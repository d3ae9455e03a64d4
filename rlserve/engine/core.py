"""The engine core: the step loop (schedule -> execute -> update), request admission,
pause modes, sleep, and the weight version (live updates: weight_updates.py).

It speaks token ids only: each step returns an EngineCoreOutputs (outputs.py), and the
front end (the offline LLM in process, the API server over ZeroMQ) detokenizes and
matches stop strings. Not thread-safe: exactly one thread drives it (the offline LLM, or
the engine-core process's busy loop, core_proc.py).
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from rlserve.config import EngineConfig
from rlserve.engine.kv_cache import KVCacheManager
from rlserve.engine.outputs import (ITERATION_TOKENS_BUCKETS, EngineCoreOutputs, EngineStats, FinalTokens, Finished,
                                    Rejected, RequestTiming, Started)
from rlserve.engine.request import (EngineUnavailableError, FinishReason, Request, RequestStatus, sample_ids,
                                    validate_prompt, version_spans)
from rlserve.engine.scheduler import Scheduler
from rlserve.errors import ConflictError, ModelNotFoundError
from rlserve.model.loader import load_hf_config, load_tokenizer, resolve_model_path
from rlserve.sampling_params import InvalidRequestError, SamplingParams
from rlserve.sequence import PLACEHOLDER
from rlserve.worker import calls as rank
from rlserve.worker.executor import Executor
from rlserve.worker.model_runner import StepHandle

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len: {requested} exceeds the model's "
                         f"max_position_embeddings ({limit})")
    return requested or limit


def _eos_ids(hf_config, tokenizer, path: str) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    try:  # generation_config.json often lists extra end-of-turn tokens
        from transformers import GenerationConfig
        gen = GenerationConfig.from_pretrained(path)
        eos = gen.eos_token_id
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    except Exception:
        pass
    return frozenset(ids)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are still on the device."""

    handle: StepHandle
    index: list[int]  # per sampling row: where its placeholder sits in the request's token_ids
    version: int  # the weights it ran on
    first: list[Request] = field(default_factory=list)  # rows sampling their request's first token


class _StepOut:
    """What a step produced, gathered as the tokens are accepted."""

    __slots__ = ("ids", "tokens", "logprobs", "any_logprobs", "started", "finished", "rejected")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.any_logprobs = False
        self.started: list[Started] = []
        self.finished: list[Finished] = []
        self.rejected: list[Rejected] = []

    def build(self, version: int, timestamp: float = 0.0) -> EngineCoreOutputs | None:
        if not (self.ids or self.finished or self.started or self.rejected):
            return None
        return EngineCoreOutputs(version, self.ids, self.tokens,
                                 self.logprobs if self.any_logprobs else None,
                                 self.started, self.finished, self.rejected, timestamp=timestamp)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(config.model)
        hf_config = load_hf_config(self.model_path, config.trust_remote_code, config.hf_overrides)
        self.hf_config = hf_config
        # Text is the front end's business; here the tokenizer only says which tokens end
        # a sequence (the offline LLM borrows it). Benchmarks on bare configs skip it.
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            config.tokenizer or self.model_path, config.trust_remote_code)
        self.max_model_len = resolve_max_model_len(hf_config, config.max_model_len)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = _eos_ids(hf_config, self.tokenizer, self.model_path)

        self.executor = Executor(config, hf_config, self.model_path)
        num_blocks = min(self.executor.collective_rpc(rank.DetermineNumBlocks()))
        self.executor.collective_rpc(rank.InitKVCache(num_blocks))
        if not config.enforce_eager:
            t1 = time.perf_counter()
            self.executor.collective_rpc(rank.CaptureCudaGraphs(config.max_num_seqs, self.max_model_len))
            logger.info("captured CUDA graphs in %.1fs", time.perf_counter() - t1)
        self.lora = None  # rlserve.engine.lora.LoRAManager, with enable_lora
        if config.enable_lora:
            from rlserve.engine.lora import LoRAManager
            self.lora = LoRAManager(self.executor, config.max_loras, config.max_cpu_loras, config.max_lora_rank)
            for name, path in config.lora_modules.items():
                self.lora.load(name, path)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.lora)
        # Overlapped scheduling needs a device that runs ahead of the host, and one rank.
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda") and self.world_size == 1
        self.inflight: _InFlight | None = None
        self.weight_version = 0
        self.paused = False
        self.pause_mode: str | None = None
        self.held: list[Request] = []  # arrived while paused: admitted on resume
        self.compiling: list[Request] = []  # waiting for their grammar: admitted once compiled
        self._grammars = None  # StructuredOutputCompiler, made at the first grammar
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.aborted_total = 0
        # vllm:iteration_tokens_total, kept here: most steps send the front end nothing
        self.iteration_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        self.load_seconds = time.perf_counter() - t0
        # Everything built so far lives as long as the engine: keep it out of the cyclic
        # collector's scans, which otherwise cost milliseconds per step at large batches.
        gc.collect()
        gc.freeze()
        logger.info("loaded %s (%s, %s) in %.1fs; KV cache: %d blocks = %d tokens",
                    config.model, type(self.executor.driver.model).__name__,
                    self.executor.driver.dtype, self.load_seconds, num_blocks,
                    self.kv.capacity_tokens)

    @property
    def world_size(self) -> int:
        return self.executor.world_size

    @property
    def device(self) -> torch.device:
        return self.executor.driver.device

    # -- requests ----------------------------------------------------------------------
    def make_requests(self, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: str, stream: bool = False,
                      cache_salt: str | None = None, lora_name: str | None = None) -> list[Request]:
        """Validate one prompt and expand it into its n sample requests. `stream`: every
        step reports the request's new token; otherwise it reports everything once, when
        the request finishes. `cache_salt`: prefix-cache blocks are shared only with
        requests of the same salt. `lora_name`: a loaded LoRA adapter to run with (its slot
        is given when the request is scheduled)."""
        validate_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size)
        if lora_name is not None:
            if self.lora is None:
                raise ModelNotFoundError(f"model: {lora_name!r} is not served (LoRA adapters need "
                                         "--enable-lora)")
            cache_salt = self.lora.resolve(lora_name).cache_salt(cache_salt)
        grammar = self._compile_grammar(params) if params.structured_outputs is not None else None
        reqs = [Request(rid, prompt_token_ids, params, self.eos_token_ids, sample_index=i,
                        max_model_len=self.max_model_len, group_id=request_id if params.n > 1 else None,
                        stream=stream, cache_salt=cache_salt, lora_name=lora_name)
                for i, rid in enumerate(sample_ids(request_id, params.n))]
        for req in reqs:
            req.grammar = grammar
        return reqs

    def _compile_grammar(self, params: SamplingParams):
        """Check a structured-output spec now (a 400 if bad) and start compiling it on a
        thread: the request is scheduled once its grammar is ready."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured_outputs: needs the tokenizer, which this "
                                      "engine was started without", "structured_outputs")
        if params.min_tokens:  # a finished grammar may allow nothing but its end
            raise InvalidRequestError("min_tokens: cannot be combined with structured outputs",
                                      "min_tokens")
        if self._grammars is None:
            from rlserve.engine.structured_output import StructuredOutputCompiler
            self._grammars = StructuredOutputCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                      limits=self.config.grammar_limits)
        self._grammars.validate(params.structured_outputs)
        return self._grammars.compile(params.structured_outputs)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.scheduler.requests or any(r.request_id == req.request_id for r in self.held):
            raise InvalidRequestError(f"request_id: {req.request_id!r} is already running", "request_id")
        if self.scheduler.no_weights:
            raise EngineUnavailableError(
                "the weights were dropped by /sleep?level=2: generation resumes after a full "
                "weight update (POST /update_weights)")
        if req.grammar is not None and req.matcher is None:
            self.compiling.append(req)
        else:
            self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        if self.paused:
            self.held.append(req)
        else:
            self.scheduler.add(req)

    def _admit_compiled(self, out: "_StepOut") -> None:
        """Requests whose grammar is ready join the queue (with their matcher); one whose
        grammar failed to compile is refused."""
        ready = [r for r in self.compiling if r.grammar.done()]
        for req in ready:
            self.compiling.remove(req)
            error = req.grammar.exception()
            if error is not None:
                req.status = RequestStatus.FINISHED
                if req.sample_index == 0:
                    out.rejected.append(Rejected(req.group_id or req.request_id, str(error),
                                                 getattr(error, "param", "structured_outputs")))
                continue
            req.matcher = self._grammars.matcher(req.grammar.result())
            self._enqueue(req)

    def abort(self, request_ids: Iterable[str]) -> list[Finished]:
        """End requests now; unknown (or already finished) ids are ignored."""
        outputs = []
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None:
                waiting = self.held if any(r.request_id == rid for r in self.held) else self.compiling
                found = [r for r in waiting if r.request_id == rid]
                if not found:
                    continue
                req = found[0]
                waiting.remove(req)
                if waiting is self.compiling and not any(r.grammar is req.grammar for r in waiting):
                    self._grammars.abandon(req.sampling_params.structured_outputs)  # nobody waits
            outputs.append(self._finish(req, FinishReason.ABORT))
            self.aborted_total += 1
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.inflight is not None or bool(self.compiling)

    def has_work(self) -> bool:
        """A step would compute something now (requests waiting for a grammar do not count:
        `step` admits them once it is ready)."""
        return self.inflight is not None or (self.scheduler.num_unfinished > 0
                                             and not self.scheduler.stopped)

    def unfinished_ids(self) -> list[str]:
        return ([*self.scheduler.requests] + [r.request_id for r in self.held]
                + [r.request_id for r in self.compiling])

    # -- the step ----------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs | None:
        """One engine step: schedule, launch on the device, then process a step's sampled
        tokens. With overlapped scheduling the step processed is the previous one: step
        N+1 is queued on the device before step N's tokens are brought back, so the
        host's scheduling and output handling hide behind the device's work.

        A step with a grammar row samples only once the grammar's mask is known, which
        needs the previous step's tokens: its forward pass is queued first, its sampling
        after the previous step is processed (still before the next launch)."""
        early = _StepOut()
        if self.compiling:
            self._admit_compiled(early)
        sched = self.scheduler.schedule()
        if self.scheduler.refused:
            self._end_refused(early)
        launched = None
        masked = False
        if not sched.empty:
            overlapped = self.async_scheduling and self.inflight is not None
            masked = any(item.request.matcher is not None for item in sched.scheduled)
            handle = self.executor.launch(sched, self._tables(sched),
                                          self.inflight.handle if overlapped else None,
                                          sample=not masked)
            placeholders, first = self._advance(sched)
            launched = _InFlight(handle, placeholders, self.weight_version, first)
        if not self.async_scheduling:
            if masked:
                self._sample_masked(launched.handle)
            outputs = self._process(launched) if launched is not None else None
        else:
            outputs = self._process(self.inflight) if self.inflight is not None else None
            if masked:
                self._sample_masked(launched.handle)
            self.inflight = launched
        if early.rejected:
            outputs = _merge(early.build(self.weight_version), outputs)
        return outputs

    def _end_refused(self, out: "_StepOut") -> None:
        """Requests the scheduler could not give their LoRA adapter end here, refused."""
        told = set()
        for req, error in self.scheduler.refused:
            self._finish(req, FinishReason.ABORT)
            group = req.group_id or req.request_id
            if group not in told:  # the front end fails the whole prompt
                told.add(group)
                out.rejected.append(Rejected(group, str(error), error.param,
                                             404 if isinstance(error, ModelNotFoundError) else 400))
        self.scheduler.refused.clear()

    def _sample_masked(self, handle) -> None:
        """Sample a launched step under its rows' grammar masks (their matchers have taken
        every token before this one)."""
        from rlserve.engine.structured_output import fill_bitmask
        finished = RequestStatus.FINISHED
        matchers = [r.matcher if r.status is not finished else None for r in handle.requests]
        self.executor.sample(handle, fill_bitmask(matchers, self.vocab_size))

    def _tables(self, sched):
        """The scheduled requests' block tables: the KV manager's array, or lists where
        they travel to other ranks in a step message."""
        if self.world_size == 1:
            return self.kv.block_table_array([item.request for item in sched.scheduled])
        return [self.kv.block_table(item.request) for item in sched.scheduled]

    def _advance(self, sched) -> tuple[list[int], list[Request]]:
        """The scheduled tokens are computed. Each request that samples this step gets a
        PLACEHOLDER for its token, which is not known until the step is collected; the
        placeholders' indexes are returned, in step order, with the requests whose first
        token this is."""
        caching, bs = self.kv.enable_prefix_caching, self.kv.block_size
        placeholders: list[int] = []
        first: list[Request] = []
        for item in sched.scheduled:
            req = item.request
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

    def _add_prompt_logprobs(self, req: Request, start: int, logprobs) -> None:
        if not req.prompt_logprobs:
            req.prompt_logprobs = [None]
        if len(req.prompt_logprobs) == start + 1:  # skip recomputed chunks
            req.prompt_logprobs.extend(logprobs)

    def _process(self, inflight: "_InFlight") -> EngineCoreOutputs | None:
        """Bring a launched step's tokens back and turn them into request state and outputs."""
        result = self.executor.collect(inflight.handle)
        now = time.monotonic()  # when these tokens were produced, as far as anyone can see
        for rid, logprobs in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self._add_prompt_logprobs(req, inflight.handle.prompt_start[rid], logprobs)
        out = _StepOut()
        version, finished = inflight.version, RequestStatus.FINISHED
        bs = self.kv.block_size
        recorded = 0
        produced = self.generation_tokens_total
        prompts = 0  # of requests whose first token this is (vLLM counts them in the step)
        for req in inflight.first:
            if req.status is not finished:
                req.first_token_time = now
                prompts += req.num_prompt_tokens
        for item, token, logprob, index in zip(result.sample_requests, result.token_ids,
                                               result.logprobs, inflight.index):
            req = item.request
            if req.status is finished:  # finished or aborted meanwhile: the token is discarded
                continue
            req.last_token_time = now
            # Most tokens of a non-streamed request only need recording: not a stop token,
            # not its last, and completing no KV block.
            if (not req.stream and index < req.last_index and (index + 1) % bs
                    and token not in req.stop_ids and req.matcher is None):
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

    def _accept(self, req: Request, token: int, logprob, version: int, index: int,
                out: _StepOut) -> None:
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
        if (kv.enable_prefix_caching and (index + 1) % kv.block_size == 0
                and req.request_id in kv.blocks):
            kv.cache_computed_blocks(req)
        n_out = index + 1 - req.num_prompt_tokens
        if req.stream:
            out.ids.append(req.request_id)
            out.tokens.append(token)
            out.logprobs.append(logprob)
            out.any_logprobs = out.any_logprobs or logprob is not None
            if n_out == 1:
                p = req.sampling_params
                out.started.append(Started(
                    req.request_id, req.num_cached_tokens,
                    req.prompt_logprobs if p.prompt_logprobs is not None else None))
        finish, stop_reason = None, None
        if req.matcher is not None and not self._advance_grammar(req, token):
            finish = FinishReason.STOP  # the grammar is complete (or could not go on)
        elif token in req.stop_ids and n_out >= req.sampling_params.min_tokens:
            finish = FinishReason.STOP
            if req.sampling_params.ignore_eos or token not in req.eos_token_ids:
                stop_reason = token  # a stop_token_ids hit, not end-of-sequence
        elif n_out >= req.max_output_tokens:
            finish = FinishReason.LENGTH
        if finish is not None:
            del token_ids[index + 1:]  # a token the next step sampled is discarded
            out.finished.append(self._finish(req, finish, stop_reason))

    @staticmethod
    def _advance_grammar(req: Request, token: int) -> bool:
        """Feed the token to the request's grammar; False once the grammar is done."""
        if not req.matcher.accept([token]):
            # Sampled under its mask, a token is always accepted; say so if not.
            logger.warning("request %s: token %d broke its grammar; the request ends here",
                           req.request_id, token)
            return False
        return not req.matcher.is_terminated()

    def _finish(self, req: Request, reason: FinishReason, stop_reason: int | None = None) -> Finished:
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.scheduler.finish(req)
        return Finished(req.request_id, reason.value, stop_reason,
                        None if req.stream else self._final(req), _timing(req, time.monotonic()))

    @staticmethod
    def _final(req: Request) -> FinalTokens:
        """Everything a non-streamed request produced."""
        n = len(req.token_versions)  # tokens read back; not one still in flight
        start = req.num_prompt_tokens
        p = req.sampling_params
        return FinalTokens(
            req.token_ids[start:start + n], list(req.logprobs) if p.logprobs is not None else None,
            [(s.version, s.start, s.end) for s in version_spans(req.token_versions)],
            req.num_cached_tokens,
            req.prompt_logprobs if n and p.prompt_logprobs is not None else None)

    # -- pause / resume ----------------------------------------------------------------
    def pause(self, mode: str = "abort", clear_cache: bool = False) -> list[Finished]:
        """Stop producing tokens. `abort` ends in-flight requests now; `keep` freezes them
        with their KV cache; `wait` lets them run on (the caller waits for `drained`).
        A later pause replaces the mode of an earlier one, except `wait` after `keep`
        with requests frozen: refused (ConflictError) at once, since draining them would
        first resume what the keep-pause froze, and its caller would wait as long as they
        run."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
        if mode == "wait" and self.pause_mode == "keep" and self.has_unfinished():
            from rlserve.engine.messages import ConflictError
            raise ConflictError(
                f"mode: wait: generation is paused with mode keep and {len(self.unfinished_ids())} "
                "requests are frozen, so waiting for them would never end; POST /resume first "
                "(then /pause?mode=wait drains them), or /pause?mode=abort to end them")
        self.paused = True
        self.pause_mode = mode
        self.scheduler.frozen = mode == "keep"
        outputs: list[Finished] = []
        if mode == "abort":
            outputs = self.abort(self.unfinished_ids())
        elif mode == "keep" and clear_cache:
            for req in reversed(list(self.scheduler.running)):
                self.scheduler.drop_kv(req)
            self.kv.reset_prefix_cache()
        return outputs

    @property
    def drained(self) -> bool:
        """Every request that was in flight when generation was paused has finished."""
        return not self.has_unfinished()

    def resume(self) -> None:
        self.paused = False
        self.pause_mode = None
        self.scheduler.frozen = False
        for req in self.held:
            self.scheduler.add(req)
        self.held.clear()

    # -- sleep / wake --------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        return self.scheduler.sleeping

    def sleep(self, level: int = 1) -> EngineCoreOutputs | None:
        """Give the device memory back (see Worker.sleep). Running requests keep their
        tokens and recompute their KV after wake-up; requests that arrive meanwhile wait.
        Level 2 drops the weights: nothing runs again until a full update arrives."""
        if level not in (1, 2):
            raise InvalidRequestError(f"level: must be 1 or 2, got {level!r}", "level")
        if self.sleeping:
            if level == 2 and not self.scheduler.no_weights:
                self.executor.collective_rpc(rank.Sleep(2))  # deepen: drop the host copy too
                self.scheduler.no_weights = True
            return None
        outputs = self._process(self.inflight) if self.inflight is not None else None
        self.inflight = None
        for req in reversed(list(self.scheduler.running)):  # keeps their order in the queue
            self.scheduler.drop_kv(req)
        self.kv.reset_prefix_cache()
        self.executor.collective_rpc(rank.Sleep(level))
        self.scheduler.sleeping = True
        self.scheduler.no_weights = level == 2
        return outputs

    def wake_up(self) -> None:
        if self.sleeping:
            self.executor.collective_rpc(rank.WakeUp())
            self.scheduler.sleeping = False

    # -- weights -----------------------------------------------------------------------
    def apply_weights(self, weights: list[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Copy tensors into the model now (offline use; the caller owns the engine thread)."""
        self.executor.load_tensors(rank.LoadWeights(), weights)
        return self.new_weight_version(version)

    # -- LoRA adapters (rlserve/engine/lora.py) ------------------------------------------
    def require_lora(self):
        if self.lora is None:
            raise InvalidRequestError("lora_name: LoRA adapters need a server started with --enable-lora",
                                      "lora_name")
        return self.lora

    def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> dict:
        """Load a PEFT adapter directory as `name`. In place (load_inplace), the requests
        running with it continue on the new weights, which is a new weight version."""
        adapter, replaced = self.require_lora().load(name, path, load_inplace)
        if replaced:
            self.new_weight_version(None)
        return adapter.info()

    def unload_lora_adapter(self, name: str) -> None:
        """Refused (ConflictError) while requests use the adapter: its slot may be reused."""
        lora = self.require_lora()
        lora.resolve(name, "lora_name")
        users = sum(r.lora_name == name for r in (*self.scheduler.requests.values(), *self.held))
        if users:
            raise ConflictError(f"lora_name: {users} request(s) still run with {name!r}; let them "
                                "finish (or /pause?mode=abort) before unloading it")
        lora.unload(name)

    def list_lora_adapters(self) -> list[dict]:
        return [] if self.lora is None else self.lora.list()

    def new_weight_version(self, version: int | None, reset_prefix_cache: bool = True) -> int:
        """The weights changed (between two steps): number them (`version`, or the next)."""
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        if reset_prefix_cache:  # KV computed under the old weights must not be reused
            self.kv.reset_prefix_cache()
        return self.weight_version

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    # -- stats -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.held) + len(self.compiling),
            kv_cache_usage=self.kv.usage,
            kv_cache_capacity_tokens=self.kv.capacity_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            aborted_total=self.aborted_total,
            preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hit_tokens=self.kv.prefix_hits,
            weight_version=self.weight_version,
            paused=self.paused,
            sleeping=self.sleeping,
            sleep_level=(2 if self.scheduler.no_weights else 1) if self.sleeping else 0,
            num_waiting_deferred=len(self.compiling) + self.scheduler.num_deferred,
            iteration_tokens=list(self.iteration_tokens),
            iteration_tokens_sum=self.iteration_tokens_sum)

    def shutdown(self) -> None:
        if self._grammars is not None:
            self._grammars.shutdown()
        self.executor.shutdown()


def _timing(req: Request, now: float) -> RequestTiming:
    """vLLM's phases of a request that ends now; those it never reached take no time."""
    arrived, scheduled, first, last = req.arrival_time, req.scheduled_time, req.first_token_time, req.last_token_time
    n = req.num_preemptions
    if not scheduled:  # ended in the queue
        return RequestTiming(now - arrived, 0.0, 0.0, 0.0, -1.0, n)
    if not first:  # ended before its first token
        return RequestTiming(scheduled - arrived, now - scheduled, 0.0, now - scheduled, -1.0, n)
    return RequestTiming(scheduled - arrived, first - scheduled, last - first, last - scheduled, now - first, n)


def _merge(a: EngineCoreOutputs | None, b: EngineCoreOutputs | None) -> EngineCoreOutputs | None:
    """Two step outputs as one (b's version wins)."""
    if a is None or b is None:
        return a or b
    b.started[:0] = a.started
    b.finished[:0] = a.finished
    b.rejected[:0] = a.rejected
    return b
