"""How much of the device the KV cache may take: measured, not estimated.

After the weights load, the worker runs the largest steps the engine will ever schedule
(a `max_num_batched_tokens` prefill with prompt logprobs, a `max_num_seqs` decode batch
with every sampling feature and the widest logprobs allowed, LoRA when enabled) over a
one-block KV cache, reads the allocator's peak, and captures the largest decode CUDA
graph to measure the graphs' pool. The KV cache gets what is left of this server's share
(`gpu_memory_utilization` of the device), as vLLM's profile run gives it.

    share = total x gpu_memory_utilization
    kv    = share - (weights + peak activations + CUDA graphs + non-torch growth)

capped by what the device has free, since another process (a colocated trainer) may hold
memory outside this server's share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from rlserve.memory import MemoryProfile
from rlserve.sampling_params import MAX_LOGPROBS, SamplingParams
from rlserve.sequence import ScheduledRequest, SchedulerOutput, Sequence

if TYPE_CHECKING:
    from rlserve.worker.model_runner import ModelRunner


class KVSizing(msgspec.Struct, array_like=True, frozen=True):
    """A rank's KV-cache size, and the measurement it came from (None: the size was given)."""

    num_blocks: int
    profile: MemoryProfile | None = None


def kv_cache_budget(profile: MemoryProfile, utilization: float) -> int:
    """Bytes for the KV cache: the rest of this server's share once everything else that
    stays on the device is counted, and no more than the device has free beside the
    activations and graphs still to come."""
    share = int(profile.total * utilization)
    return min(share - profile.non_kv, profile.free - profile.activations - profile.cuda_graphs)


def kv_cache_blocks(budget: int, bytes_per_block: int) -> int:
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache (budget {budget} bytes, {bytes_per_block} bytes "
            "per block): raise gpu_memory_utilization or kv_cache_memory_bytes, lower "
            "max_num_batched_tokens or max_num_seqs, or use a smaller model"
        )
    return int(num_blocks)


@dataclass(frozen=True)
class WorstSteps:
    """The engine's limits that decide the largest step."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    max_logprobs: int  # -1: the whole vocabulary
    capture_graphs: bool


def _worst_params(max_logprobs: int, prompt: bool) -> SamplingParams:
    # Every sampling feature that allocates on the device: top-k/p and min-p (a sort of the
    # logits), penalties, the widest logprobs. Prompt logprobs of the whole vocabulary are
    # profiled at vLLM's default width: at -1 they grow with the prompt, not the step.
    k = max_logprobs if max_logprobs >= 0 else -1
    return SamplingParams(
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        min_p=0.01,
        repetition_penalty=1.1,
        frequency_penalty=0.1,
        logprobs=k,
        prompt_logprobs=(k if k >= 0 else MAX_LOGPROBS) if prompt else None,
    )


def worst_prefill(limits: WorstSteps, lora_slot: int) -> SchedulerOutput:
    """`max_num_batched_tokens` prompt tokens in sequences of at most `max_model_len`, each
    asking for prompt logprobs."""
    params = _worst_params(limits.max_logprobs, prompt=True)
    items: list[ScheduledRequest] = []
    left = limits.max_num_batched_tokens
    while left > 0 and len(items) < limits.max_num_seqs:
        n = min(left, limits.max_model_len)
        seq = Sequence(f"profile-prefill-{len(items)}", [0] * n, params, lora_slot=lora_slot, state_slot=len(items))
        items.append(ScheduledRequest(seq, n))
        left -= n
    return SchedulerOutput(items, limits.max_num_batched_tokens - left)


def worst_decode(limits: WorstSteps, lora_slot: int) -> SchedulerOutput:
    """`max_num_seqs` sequences, each at `max_model_len`, decoding one token."""
    params = _worst_params(limits.max_logprobs, prompt=False)
    items = []
    for i in range(limits.max_num_seqs):
        seq = Sequence(f"profile-decode-{i}", [0] * limits.max_model_len, params, lora_slot=lora_slot, state_slot=i)
        seq.num_computed_tokens = limits.max_model_len - 1
        items.append(ScheduledRequest(seq, 1))
    return SchedulerOutput(items, len(items))


def _tables(sched: SchedulerOutput, max_model_len: int, block_size: int) -> np.ndarray:
    """Every block of every sequence is block 0 of the one-block cache: the kernels read and
    write as much as in a real step, on garbage that nobody reads."""
    return np.zeros((len(sched.scheduled), math.ceil(max_model_len / block_size)), dtype=np.int32)


def run_worst_steps(runner: ModelRunner, limits: WorstSteps) -> None:
    """The worst prefill, then the worst decode, on `runner`'s KV cache (one block is enough:
    every table points at block 0) and, for a hybrid model, its state pool (sequence i in
    slot i)."""
    lora_slot = 0 if runner.lora is not None else -1
    for sched in (worst_prefill(limits, lora_slot), worst_decode(limits, lora_slot)):
        tables = _tables(sched, limits.max_model_len, runner.block_size)
        rows = sum(it.samples for it in sched.scheduled)
        # A grammar's bitmask on every row: the sampler's float32 copy of the logits.
        bitmask = np.full((rows, -(-runner.model.config.vocab_size // 32)), -1, dtype=np.int32)
        runner.execute(sched, tables, bitmask)
        runner.sampling.penalties.reset()


@torch.inference_mode()
def profile_memory(runner: ModelRunner, limits: WorstSteps) -> MemoryProfile:
    """Run the worst steps on `runner` (a ModelRunner with no KV cache yet) and measure.
    Leaves the runner as it found it: no KV cache, no graphs."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info(device)
    reserved0 = torch.cuda.memory_reserved(device)
    weights = torch.cuda.memory_allocated(device)

    runner.allocate_kv_cache(1)
    runner.allocate_states(limits.max_num_seqs)  # counted apart (Worker.size_kv_cache), not as activations
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run_worst_steps(runner, limits)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - base

    graphs = 0
    if limits.capture_graphs:
        # The largest decode graph: the smaller ones share its pool.
        torch.cuda.empty_cache()
        before = torch.cuda.mem_get_info(device)[0]
        runner.capture_cuda_graphs(limits.max_num_seqs, limits.max_model_len, largest_only=True)
        torch.cuda.synchronize(device)
        graphs = max(0, before - torch.cuda.mem_get_info(device)[0])
    runner.free_kv_cache()
    torch.cuda.empty_cache()
    free1 = torch.cuda.mem_get_info(device)[0]
    reserved1 = torch.cuda.memory_reserved(device)
    # Device memory that left without the allocator's knowing: workspaces made on first use.
    non_torch = max(0, (free0 - free1) - (reserved1 - reserved0))
    return MemoryProfile(
        total=total,
        free=free1,
        weights=max(weights, reserved1),
        activations=activations,
        cuda_graphs=graphs,
        non_torch=non_torch,
    )
