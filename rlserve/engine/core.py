"""The engine core: the step loop (schedule -> execute -> update), request admission,
pause modes, and applying new weights between steps.

Not thread-safe: exactly one thread drives it (the offline LLM, or the async engine's loop).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from rlserve.config import EngineConfig
from rlserve.engine.detokenizer import IncrementalDetokenizer
from rlserve.engine.kv_cache import KVCacheManager
from rlserve.engine.request import (EngineOutput, FinishReason, InvalidRequestError, Request,
                                    RequestStatus, SamplingParams)
from rlserve.engine.scheduler import Scheduler
from rlserve.worker.model_runner import PLACEHOLDER, StepHandle
from rlserve.model.loader import load_hf_config, resolve_model_path
from rlserve.worker.executor import Executor

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_cache_capacity_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    aborted_total: int
    preemptions_total: int
    prefix_cache_hit_tokens: int
    weight_version: int
    paused: bool


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


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


class EngineCore:
    def __init__(self, config: EngineConfig, stream: bool = True):
        """`stream`: every step returns each request's new tokens (the server streams
        them). False: a request's one output, with all its tokens, comes when it finishes
        (the offline LLM), which spares building and merging a delta per token."""
        self.config = config
        self.stream = stream
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(config.model)
        hf_config = load_hf_config(self.model_path)
        for key, value in config.hf_overrides.items():
            setattr(hf_config, key, value)
        self.hf_config = hf_config
        # Benchmarks on bare configs run without a tokenizer (token ids in, token ids out).
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            config.tokenizer or self.model_path)
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({limit})")
        self.max_model_len = config.max_model_len or limit
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = _eos_ids(hf_config, self.tokenizer, self.model_path)

        self.executor = Executor(config, hf_config, self.model_path)
        num_blocks = min(self.executor.collective_rpc("determine_num_blocks"))
        self.executor.collective_rpc("init_kv_cache", num_blocks)
        if not config.enforce_eager:
            t1 = time.perf_counter()
            self.executor.collective_rpc("capture_cuda_graphs", config.max_num_seqs, self.max_model_len)
            logger.info("captured CUDA graphs in %.1fs", time.perf_counter() - t1)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Overlapped scheduling needs a device that runs ahead of the host, and one rank.
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda") and self.world_size == 1
        self.inflight: _InFlight | None = None
        self.weight_version = 0
        self.paused = False
        self.pause_mode: str | None = None
        self.held: list[Request] = []  # arrived while paused: admitted on resume
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.aborted_total = 0
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
                      request_id: str) -> list[Request]:
        """Validate one prompt and expand it into its n sample requests."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt: must contain at least one token", "prompt")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt: {n} tokens, but max_model_len is {self.max_model_len} (the prompt "
                "and at least one generated token must fit)", "prompt")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens: the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len ({self.max_model_len})", "max_tokens")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        for t in params.stop_token_ids:
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids: {t} is outside the vocabulary [0, {self.vocab_size})",
                    "stop_token_ids")
        if params.n == 1:
            return [Request(request_id, prompt_token_ids, params, self.eos_token_ids, self.max_model_len)]
        return [Request(f"{request_id}-{i}", prompt_token_ids, params, self.eos_token_ids,
                        self.max_model_len, group_id=request_id, sample_index=i)
                for i in range(params.n)]

    def add_request(self, req: Request) -> None:
        if req.request_id in self.scheduler.requests or any(r.request_id == req.request_id for r in self.held):
            raise InvalidRequestError(f"request_id: {req.request_id!r} is already running", "request_id")
        p = req.sampling_params
        if p.detokenize and self.tokenizer is not None:
            self.detokenizers[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, p.stop, p.include_stop_str_in_output,
                p.skip_special_tokens)
        if self.paused:
            self.held.append(req)
        else:
            self.scheduler.add(req)

    def abort(self, request_ids: Iterable[str]) -> list[EngineOutput]:
        outputs = []
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None:
                held = [r for r in self.held if r.request_id == rid]
                if not held:
                    continue
                req = held[0]
                self.held.remove(req)
            outputs.append(self._finish(req, FinishReason.ABORT))
            self.aborted_total += 1
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.inflight is not None

    def has_work(self) -> bool:
        return self.inflight is not None or (self.scheduler.num_unfinished > 0
                                             and not self.scheduler.stopped)

    # -- the step ----------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One engine step. With overlapped scheduling, this launches step N+1 on the
        device before bringing back step N's tokens, so the host's work of scheduling and
        output handling hides behind the device's; step N's outputs are returned."""
        if not self.async_scheduling:
            sched = self.scheduler.schedule()
            if sched.empty:
                return []
            result = self.executor.execute_model(sched, self._tables(sched))
            self._advance(sched, result.prompt_logprobs)
            outputs: list[EngineOutput] = []
            version = self.weight_version
            for item, token, logprob in zip(result.sample_requests, result.token_ids, result.logprobs):
                self._accept(item.request, token, logprob, version, None, outputs)
            return outputs

        sched = self.scheduler.schedule()
        launched = None
        if not sched.empty:
            runner = self.executor.driver.runner
            prev = self.inflight.handle if self.inflight is not None else None
            handle = runner.launch(sched, self._tables(sched), prev)
            index: list[int] = []
            self._advance(sched, None, index)
            assert len(index) == len(handle.sample_requests)
            launched = _InFlight(handle, index, self.weight_version)
        outputs = self._process(self.inflight) if self.inflight is not None else []
        self.inflight = launched
        return outputs

    def _tables(self, sched):
        """The scheduled requests' block tables: the KV manager's array, or lists where
        they travel to other ranks in a step message."""
        if self.world_size == 1:
            return self.kv.block_table_array([item.request for item in sched.scheduled])
        return [self.kv.block_table(item.request) for item in sched.scheduled]

    def _advance(self, sched, prompt_logprobs, placeholders: list[int] | None = None) -> None:
        """The scheduled tokens are computed. With `placeholders` (overlapped scheduling),
        each request that samples this step gets a PLACEHOLDER for its token, which is not
        known yet, and the placeholder's index goes to the list, in step order."""
        caching, bs = self.kv.enable_prefix_caching, self.kv.block_size
        for item in sched.scheduled:
            req = item.request
            start = req.num_computed_tokens
            end = req.num_computed_tokens = start + item.num_new_tokens
            if start < req.num_prompt_tokens:
                self.prompt_tokens_total += min(end, req.num_prompt_tokens) - start
            if caching and start // bs != end // bs:  # a block filled up
                self.kv.cache_computed_blocks(req)
            if prompt_logprobs and req.request_id in prompt_logprobs:
                self._add_prompt_logprobs(req, start, prompt_logprobs[req.request_id])
            if placeholders is not None:
                token_ids = req.token_ids
                if end == len(token_ids):  # the chunk reached the end: it samples
                    placeholders.append(end)
                    token_ids.append(PLACEHOLDER)

    def _add_prompt_logprobs(self, req: Request, start: int, logprobs) -> None:
        if not req.prompt_logprobs:
            req.prompt_logprobs = [None]
        if len(req.prompt_logprobs) == start + 1:  # skip recomputed chunks
            req.prompt_logprobs.extend(logprobs)

    def _process(self, inflight: "_InFlight") -> list[EngineOutput]:
        result = self.executor.driver.runner.collect(inflight.handle)
        for rid, logprobs in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self._add_prompt_logprobs(req, inflight.handle.prompt_start[rid], logprobs)
        outputs: list[EngineOutput] = []
        version, finished = inflight.version, RequestStatus.FINISHED
        # Without streaming or detokenizing, most tokens only need recording: a token that
        # is not a stop token, not the request's last, and completes no KV block.
        quick = not self.stream and not self.detokenizers
        bs = self.kv.block_size
        recorded = 0
        for item, token, logprob, index in zip(result.sample_requests, result.token_ids,
                                               result.logprobs, inflight.index):
            req = item.request
            if req.status is finished:  # finished or aborted meanwhile: the token is discarded
                continue
            if (quick and index < req.last_index and (index + 1) % bs
                    and token not in req.stop_ids):
                req.token_ids[index] = token
                req.token_versions.append(version)
                if logprob is not None:
                    req.logprobs.append(logprob)
                recorded += 1
                continue
            self._accept(req, token, logprob, version, index, outputs)
        self.generation_tokens_total += recorded
        return outputs

    def _accept(self, req: Request, token: int, logprob, version: int, index: int | None,
                outputs: list[EngineOutput]) -> None:
        """Record a sampled token (in place of its placeholder when `index` is given),
        decide whether the request is done, and add its output to `outputs` if there is
        one: every token when streaming, else the whole request when it finishes."""
        token_ids = req.token_ids
        if index is None:
            index = len(token_ids)
            token_ids.append(token)
        else:
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
        p = req.sampling_params
        n_out = index + 1 - req.num_prompt_tokens
        finish, stop_reason = None, None
        if token in req.stop_ids and n_out >= p.min_tokens:
            finish = FinishReason.STOP
            if p.ignore_eos or token not in req.eos_token_ids:
                stop_reason = token  # a stop_token_ids hit, not end-of-sequence
        detok = self.detokenizers.get(req.request_id) if self.detokenizers else None
        if detok is not None and finish is None:
            match = detok.add(token)
            if match is not None and n_out >= p.min_tokens:
                finish, stop_reason = FinishReason.STOP, match.stop
        if finish is None and n_out >= req.max_output_tokens:
            finish = FinishReason.LENGTH
        if finish is None:
            if self.stream:
                text = detok.take(final=False) if detok is not None else ""
                outputs.append(self._delta(req, token, logprob, text, version, index))
            return
        del token_ids[index + 1:]  # a token the next step sampled is discarded
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = finish, stop_reason
        self.scheduler.finish(req)
        self.detokenizers.pop(req.request_id, None)
        text = detok.take(final=True) if detok is not None else ""
        out = (self._delta(req, token, logprob, text, version, index) if self.stream
               else self._whole_output(req, text, version))
        out.finish_reason, out.stop_reason = finish, stop_reason
        outputs.append(out)

    @staticmethod
    def _delta(req: Request, token: int, logprob, text: str, version: int, index: int) -> EngineOutput:
        """One token's output (the streaming engine); prompt logprobs come with the first."""
        first = index == req.num_prompt_tokens
        return EngineOutput(
            req.request_id, [token], [logprob] if logprob is not None else None, text, version,
            prompt_logprobs=(req.prompt_logprobs if first and req.sampling_params.prompt_logprobs is not None
                             else None),
            num_cached_tokens=req.num_cached_tokens)

    def _whole_output(self, req: Request, text: str, version: int) -> EngineOutput:
        """Everything a request produced, as one output (the non-streaming engine)."""
        n = len(req.token_versions)  # tokens read back; not one still in flight
        start = req.num_prompt_tokens
        p = req.sampling_params
        return EngineOutput(
            req.request_id, req.token_ids[start:start + n],
            list(req.logprobs) if p.logprobs is not None else None, text, version,
            prompt_logprobs=req.prompt_logprobs if n and p.prompt_logprobs is not None else None,
            num_cached_tokens=req.num_cached_tokens, token_versions=list(req.token_versions))

    def _finish(self, req: Request, reason: FinishReason) -> EngineOutput:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.scheduler.finish(req)
        detok = self.detokenizers.pop(req.request_id, None)
        text = detok.take(final=True) if detok is not None else ""
        if not self.stream:
            out = self._whole_output(req, text, self.weight_version)
            out.finish_reason = reason
            return out
        return EngineOutput(req.request_id, [], None, text, self.weight_version,
                            finish_reason=reason, num_cached_tokens=req.num_cached_tokens)

    # -- pause / resume ----------------------------------------------------------------
    def pause(self, mode: str = "abort", clear_cache: bool = False) -> list[EngineOutput]:
        """Stop producing tokens. `abort` ends in-flight requests now; `keep` freezes them
        with their KV cache; `wait` lets them run on (the caller waits for `drained`)."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
        self.paused = True
        self.pause_mode = mode
        outputs: list[EngineOutput] = []
        if mode == "abort":
            outputs = self.abort(list(self.scheduler.requests))
        elif mode == "keep":
            self.scheduler.frozen = True
            if clear_cache:
                for req in reversed(list(self.scheduler.running)):
                    self.scheduler.drop_kv(req)
                self.kv.reset_prefix_cache()
        return outputs

    @property
    def drained(self) -> bool:
        """For `wait` pauses: every request that was in flight has finished."""
        return not self.has_unfinished() or self.pause_mode == "keep"

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

    def sleep(self, level: int = 1) -> list[EngineOutput]:
        """Give the device memory back (see Worker.sleep). Running requests keep their
        tokens and recompute their KV after wake-up; requests that arrive meanwhile wait."""
        if level not in (1, 2):
            raise InvalidRequestError(f"level: must be 1 or 2, got {level!r}", "level")
        if self.sleeping:
            return []
        outputs = self._process(self.inflight) if self.inflight is not None else []
        self.inflight = None
        for req in reversed(list(self.scheduler.running)):  # keeps their order in the queue
            self.scheduler.drop_kv(req)
        self.kv.reset_prefix_cache()
        self.executor.collective_rpc("sleep", level)
        self.scheduler.sleeping = True
        return outputs

    def wake_up(self) -> None:
        if self.sleeping:
            self.executor.collective_rpc("wake_up")
            self.scheduler.sleeping = False

    # -- weights -----------------------------------------------------------------------
    def apply_weights(self, weights: list[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Copy tensors into the model now (offline use; the caller owns the engine thread)."""
        self.executor.collective_rpc("load_weights", weights)
        return self._new_version(version)

    def apply_staged_weights(self, version: int | None = None) -> int:
        """Copy the workers' received, validated tensors into the model, between steps.

        Runs in the engine thread, so no step ever sees a half-updated model.
        """
        if self.sleeping:
            self.executor.collective_rpc("drop_staged_weights")
            raise InvalidRequestError("the server is asleep: POST /wake_up before updating weights",
                                      "update_info")
        self.executor.collective_rpc("apply_staged_weights")
        return self._new_version(version)

    def _new_version(self, version: int | None) -> int:
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        # KV computed under the old weights must not be reused by new requests.
        self.kv.reset_prefix_cache()
        return self.weight_version

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    # -- stats -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.held),
            kv_cache_usage=self.kv.usage,
            kv_cache_capacity_tokens=self.kv.capacity_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            aborted_total=self.aborted_total,
            preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.kv.prefix_hits,
            weight_version=self.weight_version,
            paused=self.paused)

    def shutdown(self) -> None:
        self.executor.shutdown()
