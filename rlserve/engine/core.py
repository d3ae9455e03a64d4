"""The engine core: the step loop (schedule -> execute -> update), request admission,
pause modes, sleep, and the weight version (live updates: weight_updates.py).

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
from typing import TYPE_CHECKING, Any, cast

import msgspec
import numpy as np
import torch

from rlserve.config import EngineConfig
from rlserve.engine.grammar_wait import GrammarWait
from rlserve.engine.kv_cache import kv_manager
from rlserve.engine.request import FinishReason, Request, RequestStatus
from rlserve.engine.route_store import RouteStore
from rlserve.engine.scheduler import Scheduler
from rlserve.engine.state import PAUSE_MODES, EngineState
from rlserve.errors import ConflictError, EngineUnavailableError, ModelNotFoundError
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
from rlserve.wire.control import Paused
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
from rlserve.worker.memory_profile import KVSizing
from rlserve.worker.model_runner import StepHandle

if TYPE_CHECKING:
    from rlserve.engine.lora import LoRAManager, ReadAdapter

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are still on the device."""

    handle: StepHandle
    index: list[int]  # per sampling row: where its placeholder sits in the request's token_ids
    version: int  # the weights it ran on
    first: list[Request] = field(default_factory=list)  # rows sampling their request's first token
    slots: np.ndarray | None = None  # routing capture: the KV slot of each of its tokens


class EngineCore:
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
        num_blocks = self._init_kv_cache()
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
        # Overlapped scheduling needs a device that runs ahead of the host, and one rank.
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        ) and self.world_size == 1
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

    def _init_kv_cache(self) -> int:
        """Size the KV cache on every rank (the smallest decides: a rank's shard of the KV heads
        is the same size everywhere, the memory beside it may not be), allocate it, then
        capture the decode graphs over it. Returns its blocks."""
        sizes = [
            msgspec.convert(r, KVSizing) for r in self.executor.collective_rpc(rank.SizeKVCache(self.max_model_len))
        ]
        sizing = min(sizes, key=lambda s: s.num_blocks)
        self.memory: MemoryProfile | None = sizing.profile
        self.executor.collective_rpc(rank.InitKVCache(sizing.num_blocks))
        if not self.config.enforce_eager:
            t = time.perf_counter()
            self.executor.collective_rpc(rank.CaptureCudaGraphs(self.config.max_num_seqs, self.max_model_len))
            logger.info("captured CUDA graphs in %.1fs", time.perf_counter() - t)
        return sizing.num_blocks

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

    def _process(self, inflight: _InFlight) -> EngineCoreOutputs | None:
        """Bring a launched step's tokens back; the scheduler turns them into request
        state and outputs."""
        result = self.executor.collect(inflight.handle)
        if result.routes is not None and inflight.slots is not None and self.kv.routes is not None:
            self.kv.routes.record(inflight.slots, result.routes)
        return self.scheduler.update_from_output(
            result, inflight.handle.prompt_start, inflight.index, inflight.first, inflight.version
        )

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
        if mode == "wait" and self.state.pause_mode == "keep" and self.has_unfinished():
            from rlserve.wire.messages import ConflictError

            raise ConflictError(
                f"mode: wait: generation is paused with mode keep and {len(self.unfinished_ids())} "
                "requests are frozen, so waiting for them would never end; POST /resume first "
                "(then /pause?mode=wait drains them), or /pause?mode=abort to end them"
            )
        self.state.pause(mode)
        outputs: list[Finished] = []
        if mode == "abort":
            outputs = self.abort(self.unfinished_ids())
            if clear_cache:  # keep: below; wait: once drained (settled_waits)
                self.kv.reset_prefix_cache()
        elif mode == "keep" and clear_cache:
            for req in reversed(list(self.scheduler.running)):
                self.scheduler.drop_kv(req)
            self.kv.reset_prefix_cache()
        return outputs

    @property
    def drained(self) -> bool:
        """Every request that was in flight when generation was paused has finished."""
        return not self.has_unfinished()

    def settled_waits(self) -> list[tuple[Any, Paused | ConflictError]]:
        """The pause(wait) calls (state.waits) whose condition holds now, each with its
        answer; they leave `waits`. One holds once the requests in flight have finished, or
        can no longer run (a later keep-pause, or sleep: they are kept, and the answer says
        so), or generation was resumed meanwhile (an error)."""
        state = self.state
        settled: list[tuple[Any, Paused | ConflictError]] = []
        for call in list(state.waits):
            answer: Paused | ConflictError
            if not state.paused:
                answer = ConflictError("mode: generation was resumed before the requests in flight finished")
            elif self.drained:
                if call.body.clear_cache:
                    self.reset_prefix_cache()
                answer = Paused("wait")
            elif state.pause_mode == "keep" or state.sleeping:
                answer = Paused("keep", self.scheduler.num_unfinished)
            else:
                continue
            state.waits.remove(call)
            settled.append((call, answer))
        return settled

    def resume(self) -> None:
        self.state.resume()
        for req in self.held:
            self.scheduler.add(req)
        self.held.clear()

    # -- sleep / wake --------------------------------------------------------------------
    def sleep(self, level: int = 1) -> EngineCoreOutputs | None:
        """Give the device memory back (see Worker.sleep). Running requests keep their
        tokens and recompute their KV after wake-up; requests that arrive meanwhile wait.
        Level 2 drops the weights: nothing runs again until a full update arrives (the
        caller ends the requests in flight first). Level 0, as vLLM's, only stops
        scheduling: nothing is given back."""
        if level not in (0, 1, 2):
            raise InvalidRequestError(f"level: must be 0, 1 or 2, got {level!r}", "level")
        state = self.state
        if state.sleeping and (level == 0 or (state.weights_asleep and (level == 1 or state.no_weights))):
            return None  # as deep already
        # Deeper than now: from level 0, from weights woken alone, or level 1 to 2.
        outputs = self._process(self.inflight) if self.inflight is not None else None
        self.inflight = None
        state.sleeping = True
        if level == 0:
            state.asleep = frozenset({"scheduling"})
            return outputs
        for req in reversed(list(self.scheduler.running)):  # keeps their order in the queue
            self.scheduler.drop_kv(req)
        self.kv.reset_prefix_cache()
        self.executor.collective_rpc(rank.Sleep(level))
        state.asleep = frozenset({"weights", "kv_cache"})
        if level == 2:
            state.no_weights = True
        return outputs

    def release_kv_cache(self) -> EngineCoreOutputs | None:
        """Give the KV cache back, the weights kept (vLLM's release_kv_cache_memory): the
        requests in flight keep their tokens and recompute after /wake_up (tags kv_cache)."""
        if self.state.sleeping:
            asleep = ", ".join(sorted(self.state.asleep))
            raise ConflictError(
                f"release_kv_cache_memory: the engine is asleep already ({asleep}); POST /wake_up first"
            )
        outputs = self._process(self.inflight) if self.inflight is not None else None
        self.inflight = None
        for req in reversed(list(self.scheduler.running)):
            self.scheduler.drop_kv(req)
        self.kv.reset_prefix_cache()
        self.executor.collective_rpc(rank.ReleaseKVCache())
        self.state.asleep = frozenset({"kv_cache"})
        self.state.sleeping = True
        return outputs

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake what `tags` names ("weights", "kv_cache"; None: everything). The engine
        sleeps until everything is awake: an RL loop wakes the weights, updates them, then
        wakes the KV cache (vLLM's order)."""
        wanted = set(tags) if tags else {"weights", "kv_cache", "scheduling"}
        unknown = sorted(wanted - {"weights", "kv_cache", "scheduling"})
        if unknown:
            raise InvalidRequestError(
                f"tags: unknown tag(s) {', '.join(map(repr, unknown))} (known: 'weights', 'kv_cache')", "tags"
            )
        state = self.state
        waking = sorted(state.asleep & wanted - {"scheduling"})
        if waking:
            self.executor.collective_rpc(rank.WakeUp(waking))
        state.asleep = frozenset(state.asleep - wanted - {"scheduling"})  # any wake ends a level-0 sleep
        state.sleeping = bool(state.asleep)

    # -- weights -----------------------------------------------------------------------
    def apply_weights(self, weights: list[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Copy tensors into the model now (offline use; the caller owns the engine thread)."""
        self.executor.load_tensors(rank.LoadWeights(), weights)
        return self.new_weight_version(version)

    # -- LoRA adapters (rlserve/engine/lora.py) ------------------------------------------
    def require_lora(self) -> LoRAManager:
        if self.lora is None:
            raise InvalidRequestError("lora_name: LoRA adapters need a server started with --enable-lora", "lora_name")
        return self.lora

    def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> dict:
        """Load a PEFT adapter directory as `name`. In place (load_inplace), the requests
        running with it continue on the new weights, which is a new weight version."""
        return self.install_lora_adapter(self.require_lora().read(name, path, load_inplace))

    def install_lora_adapter(self, read: ReadAdapter) -> dict:
        """An adapter read off the engine thread (LoRAManager.read), put in place now."""
        adapter, replaced = self.require_lora().install(read)
        if replaced:
            self.new_weight_version(None)
        return adapter.info()

    def unload_lora_adapter(self, name: str) -> None:
        """Refused (ConflictError) while requests use the adapter: its slot may be reused."""
        lora = self.require_lora()
        lora.resolve(name, "lora_name")
        users = sum(r.lora_name == name for r in (*self.scheduler.requests.values(), *self.held))
        if users:
            raise ConflictError(
                f"lora_name: {users} request(s) still run with {name!r}; let them "
                "finish (or /pause?mode=abort) before unloading it"
            )
        lora.unload(name)

    def list_lora_adapters(self) -> list[dict]:
        return [] if self.lora is None else self.lora.list()

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
