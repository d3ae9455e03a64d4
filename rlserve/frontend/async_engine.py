"""The API server's engine: requests in, per-request state out, control calls through.

The engine core runs in a process of its own (core_proc.py). This object lives on the
server's event loop: it validates a request and sends it, turns each step message into
per-request state (output_processor.py: tokens, text, stop strings) and wakes whoever
consumes that request. Nothing here waits on a model step.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlserve.config import EngineConfig
from rlserve.errors import InvalidUpdateError
from rlserve.frontend.core_client import EngineAddresses, EngineCoreClient
from rlserve.frontend.output_processor import LatencyObserver, OutputProcessor, RequestState
from rlserve.frontend.request_output import RequestOutput
from rlserve.sampling_params import InvalidRequestError, SamplingParams
from rlserve.weight_transfer.info import InitInfo, UpdateInfo
from rlserve.wire.control import (
    Paused,
    TransferShutDown,
    WeightsUpdated,
    WeightUpdateFinished,
    WeightUpdateStarted,
    WeightVersionSet,
)
from rlserve.wire.limits import check_int_range
from rlserve.wire.messages import (
    AbortAll,
    AnyControlCall,
    EngineDeadError,
    EngineReady,
    FinishWeightUpdate,
    GetStats,
    InitWeightTransfer,
    ListLoRAAdapters,
    LoadLoRAAdapter,
    LoRAAdapterInfo,
    Pause,
    ReleaseKVCache,
    ResetPrefixCache,
    Resume,
    SetWeightVersion,
    ShutdownWeightTransfer,
    Sleep,
    StartWeightUpdate,
    UnloadLoRAAdapter,
    UpdateWeights,
    WakeUp,
    WeightChecksums,
)
from rlserve.wire.outputs import EngineCoreOutputs, EngineStats, check_return_routed_experts
from rlserve.wire.validation import check_cache_salt, sample_ids, validate_prompt
from rlserve.wire.weight_version import parse_version

if TYPE_CHECKING:
    from rlserve.frontend.dp_client import DPEngineClient

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError"]


def _front_end_tokenizer(config: EngineConfig):
    if config.skip_tokenizer_init:
        return None
    from rlserve.model.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(config.tokenizer or resolve_model_path(config.model), config.trust_remote_code)


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, client_index: int = 0, num_clients: int = 1,
                 addresses: EngineAddresses | None = None, log_level: str = "info"):
        """Starts the engine-core process (unless `addresses` names a running one); call
        `await start()` on the serving loop before use. The tokenizer loads here, while
        the engine loads the model."""
        self.config = config
        self.model_name = config.name
        self.client: EngineCoreClient | DPEngineClient
        if config.data_parallel_size > 1:
            from rlserve.frontend.dp_client import DPEngineClient
            self.client = DPEngineClient(config, log_level=log_level)
        else:
            self.client = EngineCoreClient(config, client_index=client_index, num_clients=num_clients,
                                           addresses=addresses, log_level=log_level)
        self.tokenizer = _front_end_tokenizer(config)
        self.processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.info: EngineReady  # set by start()
        self.weight_version = 0  # of the latest tokens seen
        self.weight_labels: dict[int, str] = {}  # version -> its label, as the engine's outputs tell (the latest few)
        self.on_dead: Callable[[str], None] | None = None  # told once, after requests failed
        self._ids = itertools.count()

    def set_latency_observer(self, observer: LatencyObserver) -> None:
        self.processor.observer = observer

    async def start(self) -> EngineReady:
        self.client.on_outputs = self._on_outputs
        self.client.on_dead = self._on_dead
        if hasattr(self.client, "on_request_failed"):  # data parallel: one replica died
            self.client.on_request_failed = self._on_request_failed
        self.info = await self.client.start()
        self.weight_version = self.info.weight_version
        self.processor.routes_expected = self.info.routed_experts
        return self.info

    # -- what the engine serves ------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for (--max-logprobs; -1: the whole vocabulary)."""
        return self.config.max_logprobs

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def dead(self) -> str | None:
        return self.client.dead

    # -- requests ----------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *,
                    request_id: str | None = None, prompt: str | None = None,
                    arrival: float | None = None, notify: Callable[[], None] | None = None,
                    stream: bool = False, cache_salt: str | None = None,
                    lora_name: str | None = None) -> RequestState:
        """Validate and send one prompt (all its n samples). `notify` is called as its
        state changes: after every engine step with `stream`, else once, at the end.
        `lora_name`: a loaded LoRA adapter to run with (the engine resolves it: 404 if not
        loaded), None for the base model."""
        validate_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size, self.max_logprobs)
        check_return_routed_experts(params.return_routed_experts, self.info.moe, self.info.routed_experts)
        check_cache_salt(cache_salt)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already running", "request_id")
        state = RequestState(request_id, prompt, prompt_token_ids, params, arrival, notify, stream)
        state.weight_labels = self.weight_labels
        self.client.add_request(request_id, prompt_token_ids, params,
                                stream or OutputProcessor.needs_steps(params), cache_salt, lora_name)
        self.processor.add(state)
        self.requests[request_id] = state
        return state

    def release(self, state: RequestState) -> None:
        """The consumer is done with a request: forget it, and abort what still runs."""
        self.requests.pop(state.request_id, None)
        self.client.abort(self.processor.remove(state))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, prompt: str | None = None) -> RequestOutput:
        """One prompt's whole result (a convenience for scripts and tests)."""
        import asyncio
        done = asyncio.Event()
        state = self.add_request(prompt_token_ids, params, request_id=request_id, prompt=prompt,
                                 notify=done.set)
        try:
            await done.wait()
            if state.error is not None:
                raise state.error
            return state.output()
        finally:
            self.release(state)

    def _on_outputs(self, out: EngineCoreOutputs) -> None:
        self.weight_version = out.version
        if out.label is not None and self.weight_labels.get(out.version) != out.label:
            self.weight_labels[out.version] = out.label
            if len(self.weight_labels) > 64:
                del self.weight_labels[next(iter(self.weight_labels))]
        aborts = self.processor.process(out)
        if aborts:  # stop strings ended these samples here
            self.client.abort(aborts)
        for r in out.rejected:
            state = self.requests.get(r.request_id)
            if state is not None:
                self.processor.fail(state, r.error())

    def _on_request_failed(self, request_id: str, error: BaseException) -> None:
        state = self.requests.get(request_id)
        if state is not None:
            self.processor.fail(state, error)

    @property
    def replicas(self) -> list[dict] | None:
        """Data parallel: each replica's state (for /health), else None."""
        status = getattr(self.client, "status", None)
        return status() if status is not None else None

    def replica_metrics(self) -> str:
        render = getattr(self.client, "render_metrics", None)
        return render() if render is not None else ""

    def _on_dead(self, reason: str) -> None:
        self.processor.fail_all(EngineDeadError(f"the engine is down: {reason}"))
        if self.on_dead is not None:
            self.on_dead(reason)

    # -- control plane (one typed call each: messages.py) ----------------------------------
    async def call(self, body: AnyControlCall) -> Any:
        return await self.client.call(body)

    async def stats(self) -> EngineStats:
        return await self.call(GetStats())

    async def pause(self, mode: str = "abort", clear_cache: bool = False) -> Paused:
        """Stop producing tokens; for `wait`, answers once the requests in flight finished."""
        return await self.call(Pause(mode, clear_cache))

    async def resume(self) -> None:
        await self.call(Resume())

    def version_label(self, version: int) -> str:
        """A version as vLLM reports it: its label, or its number as a string."""
        return self.weight_labels.get(version, str(version))

    async def sleep(self, level: int = 1) -> None:
        await self.call(Sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call(WakeUp(tags))

    async def release_kv_cache(self) -> None:
        await self.call(ReleaseKVCache())

    async def reset_prefix_cache(self) -> None:
        await self.call(ResetPrefixCache())

    async def abort_all(self) -> int:
        return await self.call(AbortAll())

    def abort_requests(self, request_ids: list[str]) -> int:
        """End these requests now (their responses finish with reason abort): a response's
        id names its prompt, or all of its prompts (`id-0`, `id-1`, ... here). Ids that are
        not running here are ignored. Returns how many requests were ended."""
        wanted = set(request_ids)
        found = [state for rid, state in self.requests.items()
                 if rid in wanted or (rid.rpartition("-")[2].isdigit() and rid.rpartition("-")[0] in wanted)]
        samples = [sid for state in found for sid in sample_ids(state.request_id, state.params.n)]
        self.client.abort(samples)
        return len(found)

    # -- LoRA adapters (rlserve/engine/lora.py) ------------------------------------------
    async def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> LoRAAdapterInfo:
        return await self.call(LoadLoRAAdapter(name, path, load_inplace))

    async def unload_lora_adapter(self, name: str) -> None:
        await self.call(UnloadLoRAAdapter(name))

    async def list_lora_adapters(self) -> list[LoRAAdapterInfo]:
        return await self.call(ListLoRAAdapters())

    # -- weight updates (rlserve/engine/weight_updates.py) ----------------------------------
    async def init_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's group; answers once the group has formed. init_info is parsed
        here, once: the engine and every rank get the typed value."""
        from rlserve.weight_transfer.ipc import parse_ipc_init_info
        cfg = self.config.weight_transfer
        if cfg is None:
            raise InvalidRequestError("no weight-transfer backend is configured", "init_info")
        info = None  # the ipc backend forms no group
        if cfg.backend == "ipc":
            parse_ipc_init_info(init_info)
        else:
            info = InitInfo.parse(init_info, num_workers=self.world_size,
                                  max_world_size=cfg.max_world_size)  # a 400 before anything blocks
        await self.call(InitWeightTransfer(cfg.backend, info, cfg.timeout_s))

    async def update_weights(self, update_info: dict) -> WeightsUpdated:
        """Receive a whole update into staging, then swap it in between two steps (inside a
        transaction: stage it until /finish_weight_update).

        update_info is parsed here, once: the engine and every rank get the typed value.
        Generation goes on while the bytes arrive (unless paused); a failed or refused
        transfer leaves the previous weights serving.
        """
        transaction_id, refusal, param, info = None, None, None, None
        try:
            if isinstance(update_info, dict):
                transaction_id = update_info.pop("transaction_id", None)
                if transaction_id is not None and not (isinstance(transaction_id, str) and len(transaction_id) <= 128):
                    raise InvalidRequestError("update_info.transaction_id: must be a string of at most 128 "
                                              f"characters, got {type(transaction_id).__name__}", "update_info")
            version = parse_version(update_info.get("weight_version") if isinstance(update_info, dict) else None,
                                    "update_info.weight_version")
            check_int_range(update_info, "update_info")
            backend = self.config.weight_transfer.backend if self.config.weight_transfer else None
            info = UpdateInfo.parse(update_info, references=backend == "ipc")
        except (InvalidRequestError, InvalidUpdateError) as e:
            # Refused here, it still goes to the engine, so a trainer that is sending hears
            # the refusal at once instead of waiting out its timeout for the server's answer.
            version, refusal, param, info, transaction_id = None, str(e), e.param, None, None
        result: WeightsUpdated = await self.call(UpdateWeights(info, version, transaction_id, refusal, param))
        logger.info("weights %s version %d: %.1f MB received in %.3fs, applied in %.3fs",
                    "staged at" if result.staged else "updated to", result.weight_version,
                    result.num_bytes / 1e6, result.receive_seconds, result.apply_seconds)
        return result

    async def start_weight_update(self, is_checkpoint_format: bool = True,
                                  transaction_id: str | None = None) -> WeightUpdateStarted:
        return await self.call(StartWeightUpdate(is_checkpoint_format, transaction_id))

    async def finish_weight_update(self, weight_version: Any = None,
                                   transaction_id: str | None = None) -> WeightUpdateFinished:
        return await self.call(FinishWeightUpdate(parse_version(weight_version), transaction_id))

    async def update_weight_version(self, new_version: Any) -> WeightVersionSet:
        version = parse_version(new_version, "new_version")
        if version is None:
            raise InvalidRequestError("new_version: required (an integer or a string)", "new_version")
        answer: WeightVersionSet = await self.call(SetWeightVersion(version))
        self.weight_version = answer.number
        return answer

    async def weight_checksums(self) -> list[dict[str, str]]:
        """Every rank's digest of each of its parameters (replicas after one another)."""
        return await self.call(WeightChecksums())

    async def reset_weights(self) -> None:
        """Noise over every parameter (/weight_checker's reset): served only after a full update."""
        await self.call(WeightChecksums(reset=True))

    async def shutdown_weight_transfer(self) -> TransferShutDown:
        return await self.call(ShutdownWeightTransfer())

    async def shutdown(self) -> None:
        await self.client.shutdown()
