"""The engine core: the step loop (schedule -> execute -> update), request admission, and
the weight version (live updates: weight_updates.py). Pausing (pause.py), sleep mode
(sleep.py) and the LoRA adapter calls (lora_adapters.py) are its mixins.

It speaks token ids only: each step returns an EngineCoreOutputs (outputs.py), and the
front end (the offline LLM in process, the API server over ZeroMQ) detokenizes and
matches stop strings. Not thread-safe: exactly one thread drives it (the offline LLM, or
the engine-core process's busy loop, core_proc.py).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from rlserve.config import EngineConfig
from rlserve.engine.grammar_wait import GrammarWait
from rlserve.engine.kv_cache import kv_manager
from rlserve.engine.kv_sizing import init_kv_cache
from rlserve.engine.lora_adapters import EngineLoRA
from rlserve.engine.pause import EnginePause
from rlserve.engine.request import FinishReason, Request, RequestStatus
from rlserve.engine.route_store import RouteStore
from rlserve.engine.scheduler import Scheduler
from rlserve.engine.sleep import EngineSleep
from rlserve.engine.state import EngineState
from rlserve.errors import EngineUnavailableError, ModelNotFoundError
from rlserve.memory import GiB, MemoryProfile
from rlserve.model.loader import (
    eos_token_ids,
    load_hf_config,
    load_tokenizer,
    resolve_max_model_len,
    resolve_model_path,
)
from rlserve.model.moe import config_value
from rlserve.sampling_params import InvalidRequestError, SamplingParams
from rlserve.sequence import SchedulerOutput
from rlserve.wire.outputs import (
    EngineCoreOutputs,
    EngineStats,
    Finished,
    Rejected,
    StepOut,
    check_return_routed_experts,
    merge_outputs,
)
from rlserve.wire.validation import sample_ids, validate_prompt
from rlserve.worker import calls as rank
from rlserve.worker.executor import Executor
from rlserve.worker.model_runner import StepHandle

if TYPE_CHECKING:
    from rlserve.engine.lora import LoRAManager

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are still on the device."""

    handle: StepHandle
    index: list[int]  # per sampling row: where its placeholder sits in the request's token_ids
    version: int  # the weights it ran on
    first: list[Request] = field(default_factory=list)  # rows sampling their request's first token
    slots: np.ndarray | None = None  # routing capture: the KV slot of each of its tokens


class EngineCore(EnginePause, EngineSleep, EngineLoRA):
    def __init__(self, config: EngineConfig):
        self.config = config
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(config.model)
        hf_config = load_hf_config(self.model_path, config.trust_remote_code, config.hf_overrides)
        self.hf_config = hf_config
        # Text is the front end's business; here the tokenizer only says which tokens end
        # a sequence (the offline LLM borrows it). Benchmarks on bare configs skip it.
        self.tokenizer = (
            None
            if config.skip_tokenizer_init
            else load_tokenizer(config.tokenizer or self.model_path, config.trust_remote_code)
        )
        self.max_model_len = resolve_max_model_len(hf_config, config.max_model_len)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = eos_token_ids(hf_config, self.tokenizer, self.model_path)

        self.executor = Executor(config, hf_config, self.model_path)
        sizing = init_kv_cache(self.executor, config, self.max_model_len)
        self.memory: MemoryProfile | None = sizing.profile
        num_blocks = sizing.num_blocks
        self.lora: LoRAManager | None = None  # with enable_lora
        if config.enable_lora:
            from rlserve.engine.lora import LoRAManager

            assert config.max_cpu_loras is not None  # EngineConfig sets it (to max_loras by default)
            self.lora = LoRAManager(self.executor, config.max_loras, config.max_cpu_loras, config.max_lora_rank)
            for name, path in config.lora_modules.items():
                self.lora.load(name, path)
        info = self.executor.info
        self.kv = kv_manager(info, num_blocks, config)
        # Routing replay: whether the model has MoE layers, and the capture when it runs
        self.moe = info.moe
        if info.routes_shape is not None:
            experts = int(config_value(hf_config, "num_experts", "num_local_experts", default=0))
            self.kv.routes = RouteStore(self.kv.capacity_tokens, *info.routes_shape, experts)
        self.state = EngineState()  # paused, asleep, without weights: what stops the steps
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.state, self.lora)
        # Overlapped scheduling needs a device that runs ahead of the host; at TP > 1 it is
        # correct (rank 0 broadcasts its tokens) but off by default until measured there.
        default_overlap = self.device.type == "cuda" and self.world_size == 1
        self.async_scheduling = default_overlap if config.async_scheduling is None else config.async_scheduling
        self.inflight: _InFlight | None = None
        self.weight_version = 0
        self.weight_labels: dict[int, str] = {}  # number -> the label it was served under (the latest few)
        self.held: list[Request] = []  # arrived while paused: admitted on resume
        self.grammars = GrammarWait(self.tokenizer, self.vocab_size, self.eos_token_ids, config.grammar_limits)
        self.aborted_total = 0
        self.load_seconds = time.perf_counter() - t0
        # Everything built so far lives as long as the engine: keep it out of the cyclic
        # collector's scans, which otherwise cost milliseconds per step at large batches.
        gc.collect()
        gc.freeze()
        self._log_loaded(num_blocks)

    def _log_loaded(self, num_blocks: int) -> None:
        info = self.executor.info
        logger.info(
            "loaded %s (%s, %s) in %.1fs; KV cache: %d blocks = %d tokens",
            self.config.model,
            info.model_type,
            info.dtype,
            self.load_seconds,
            num_blocks,
            self.kv.capacity_tokens,
        )
        if self.memory is not None:
            logger.info(
                "device memory (%.2f GiB, %.0f%% this server's): %s",
                self.memory.total / GiB,
                100 * self.config.gpu_memory_utilization,
                self.memory.describe(self.kv.capacity_tokens),
            )

    @property
    def world_size(self) -> int:
        return self.executor.world_size

    @property
    def device(self) -> torch.device:
        return self.executor.info.device

    # -- requests ----------------------------------------------------------------------
    def make_requests(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        stream: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list[Request]:
        """Validate one prompt and expand it into its n sample requests. `stream`: every
        step reports the request's new token; otherwise it reports everything once, when
        the request finishes. `cache_salt`: prefix-cache blocks are shared only with
        requests of the same salt. `lora_name`: a loaded LoRA adapter to run with (its slot
        is given when the request is scheduled)."""
        validate_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size, self.config.max_logprobs)
        check_return_routed_experts(params.return_routed_experts, self.moe, self.kv.routes is not None)
        if lora_name is not None:
            if self.lora is None:
                raise ModelNotFoundError(f"model: {lora_name!r} is not served (LoRA adapters need --enable-lora)")
            cache_salt = self.lora.resolve(lora_name).cache_salt(cache_salt)
        spec = params.structured_outputs
        grammar = self.grammars.compile(spec, params) if spec is not None else None
        reqs = [
            Request(
                rid,
                prompt_token_ids,
                params,
                self.eos_token_ids,
                sample_index=i,
                max_model_len=self.max_model_len,
                group_id=request_id if params.n > 1 else None,
                stream=stream,
                cache_salt=cache_salt,
                lora_name=lora_name,
            )
            for i, rid in enumerate(sample_ids(request_id, params.n))
        ]
        for req in reqs:
            req.grammar = grammar
        return reqs

    def add_request(self, req: Request) -> None:
        if req.request_id in self.scheduler.requests or any(r.request_id == req.request_id for r in self.held):
            raise InvalidRequestError(f"request_id: {req.request_id!r} is already running", "request_id")
        if self.state.no_weights:
            raise EngineUnavailableError(
                "the weights were dropped by /sleep?level=2: generation resumes after a full "
                "weight update (POST /update_weights)"
            )
        if req.grammar is not None and req.matcher is None:
            self.grammars.add(req)
        else:
            self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        if self.state.paused:
            self.held.append(req)
        else:
            self.scheduler.add(req)

    def abort(self, request_ids: Iterable[str]) -> list[Finished]:
        """End requests now; unknown (or already finished) ids are ignored."""
        outputs = []
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None:
                req = next((r for r in self.held if r.request_id == rid), None)
                if req is not None:
                    self.held.remove(req)
                else:
                    req = self.grammars.take(rid)
                if req is None:
                    continue
            outputs.append(self.scheduler.finish(req, FinishReason.ABORT))
            self.aborted_total += 1
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.inflight is not None or bool(self.grammars)

    def has_work(self) -> bool:
        """A step would compute something now (requests waiting for a grammar do not count:
        `step` admits them once it is ready)."""
        return self.inflight is not None or (self.scheduler.num_unfinished > 0 and not self.scheduler.stopped)

    def unfinished_ids(self) -> list[str]:
        return (
            [*self.scheduler.requests]
            + [r.request_id for r in self.held]
            + [r.request_id for r in self.grammars.waiting]
        )

    # -- the step ----------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs | None:
        """One engine step: schedule, launch on the device, then process a step's sampled
        tokens. With overlapped scheduling the step processed is the previous one: step
        N+1 is queued on the device before step N's tokens are brought back, so the
        host's scheduling and output handling hide behind the device's work.

        A step with a grammar row samples only once the grammar's mask is known, which
        needs the previous step's tokens: its forward pass is queued first, its sampling
        after the previous step is processed (still before the next launch)."""
        early = StepOut()
        if self.grammars:
            self.grammars.admit_ready(early.rejected, self._enqueue)
        sched = self.scheduler.schedule()
        if self.scheduler.refused:
            self._end_refused(early)
        launched = None
        masked = False
        if not sched.empty:
            overlapped = self.inflight if self.async_scheduling else None  # the step still on the device
            # The scheduler's batch holds Requests (ScheduledRequest types them as Sequences).
            masked = any(cast(Request, item.request).matcher is not None for item in sched.scheduled)
            handle = self.executor.launch(
                sched, self._tables(sched), overlapped.handle if overlapped is not None else None, sample=not masked
            )
            slots = self.kv.step_slots(sched.scheduled) if self.kv.routes is not None else None
            placeholders, first = self.scheduler.advance(sched)
            launched = _InFlight(handle, placeholders, self.weight_version, first, slots)
        if not self.async_scheduling:
            if masked:
                assert launched is not None  # masked rows were launched
                self._sample_masked(launched.handle)
            outputs = self._process(launched) if launched is not None else None
        else:
            outputs = self._process(self.inflight) if self.inflight is not None else None
            if masked:
                assert launched is not None
                self._sample_masked(launched.handle)
            self.inflight = launched
        if early.rejected:
            outputs = merge_outputs(early.build(self.weight_version), outputs)
        return outputs

    def _end_refused(self, out: StepOut) -> None:
        """Requests the scheduler could not give their LoRA adapter end here, refused."""
        told = set()
        for req, error in self.scheduler.refused:
            self.scheduler.finish(req, FinishReason.ABORT)
            group = req.group_id or req.request_id
            if group not in told:  # the front end fails the whole prompt
                told.add(group)
                out.rejected.append(Rejected.of(group, error))
        self.scheduler.refused.clear()

    def _sample_masked(self, handle: StepHandle) -> None:
        """Sample a launched step under its rows' grammar masks (their matchers have taken
        every token before this one)."""
        from rlserve.engine.structured_output import fill_bitmask

        finished = RequestStatus.FINISHED
        matchers = [r.matcher if r.status is not finished else None for r in handle.requests]
        self.executor.sample(handle, fill_bitmask(matchers, self.vocab_size))

    def _tables(self, sched: SchedulerOutput) -> np.ndarray | list[list[int]]:
        """The scheduled requests' block tables: the KV manager's array, or lists where
        they travel to other ranks in a step message."""
        if self.world_size == 1:
            return self.kv.block_table_array([item.request for item in sched.scheduled])
        return [self.kv.block_table(item.request) for item in sched.scheduled]

    def _process_inflight(self) -> EngineCoreOutputs | None:
        """Process the step still on the device, if any: the engine stops stepping."""
        outputs = self._process(self.inflight) if self.inflight is not None else None
        self.inflight = None
        return outputs

    def _process(self, inflight: _InFlight) -> EngineCoreOutputs | None:
        """Bring a launched step's tokens back; the scheduler turns them into request
        state and outputs."""
        result = self.executor.collect(inflight.handle)
        if result.routes is not None and inflight.slots is not None and self.kv.routes is not None:
            self.kv.routes.record(inflight.slots, result.routes)
        return self.scheduler.update_from_output(
            result, inflight.handle.prompt_start, inflight.index, inflight.first, inflight.version
        )

    # -- weights -----------------------------------------------------------------------
    def apply_weights(self, weights: list[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Copy tensors into the model now (offline use; the caller owns the engine thread)."""
        self.executor.load_tensors(rank.LoadWeights(), weights)
        return self.new_weight_version(version)

    def new_weight_version(self, version: int | str | None, reset_prefix_cache: bool = True) -> int:
        """The weights changed (between two steps): number them (`version`, or the next;
        a label, rlserve.wire.weight_version, names the next number)."""
        if isinstance(version, str):
            self.weight_version += 1
            self.weight_labels[self.weight_version] = version
            for old in list(self.weight_labels)[:-64]:  # what responses still in flight may report
                del self.weight_labels[old]
        else:
            self.weight_version = self.weight_version + 1 if version is None else int(version)
            self.weight_labels.pop(self.weight_version, None)
        if reset_prefix_cache:  # KV computed under the old weights must not be reused
            self.kv.reset_prefix_cache()
        return self.weight_version

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    @property
    def weight_label(self) -> str:
        """The served version as vLLM reports it: its label, or its number as a string."""
        return self.weight_labels.get(self.weight_version, str(self.weight_version))

    # -- stats -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.held) + len(self.grammars),
            kv_cache_usage=self.kv.usage,
            kv_cache_capacity_tokens=self.kv.capacity_tokens,
            prompt_tokens_total=self.scheduler.prompt_tokens_total,
            generation_tokens_total=self.scheduler.generation_tokens_total,
            aborted_total=self.aborted_total,
            preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hit_tokens=self.kv.prefix_hits,
            weight_version=self.weight_version,
            paused=self.state.paused,
            sleeping=self.state.sleeping,
            weight_label=self.weight_labels.get(self.weight_version),
            asleep=sorted(self.state.asleep),
            sleep_level=self.state.sleep_level,
            num_waiting_deferred=len(self.grammars) + self.scheduler.num_deferred,
            iteration_tokens=list(self.scheduler.iteration_tokens),
            iteration_tokens_sum=self.scheduler.iteration_tokens_sum,
        )

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()
        # Frozen objects are never collected: the engine's cycles would outlive it in a
        # process that goes on (the offline LLM's caller, a test suite).
        gc.unfreeze()
