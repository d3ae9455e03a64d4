"""Sampling from a batch of logits, one row per request, with per-row parameters.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws from p
exactly and lets each seeded row take its noise from its own generator, so a seeded
request gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = float("-inf")


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, as tensors on the logits' device."""

    temperature: torch.Tensor  # [R] float32, 0 = greedy
    top_p: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64, 0 = off
    min_p: torch.Tensor  # [R] float32
    seeds: list[tuple[int, int]]  # (row, seed already mixed with the step) of seeded rows, in row order
    banned: list[tuple[int, int]]  # (row, token id) masked out (eos while below min_tokens)
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_logprobs: int  # the largest top-k alternatives any row asked for; -1 = none
    # On CUDA: one Philox key per row (the request's per-token seed, or a fresh random one),
    # which selects the fused Gumbel-max path for plain temperature sampling.
    noise_seeds: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None  # [R] raw logprob of each sampled token
    ranks: torch.Tensor | None  # [R]
    top_ids: torch.Tensor | None  # [R, K]
    top_logprobs: torch.Tensor | None  # [R, K]


def mix_seed(seed: int, sample_index: int, position: int) -> int:
    """A per-token seed: deterministic in (request seed, sample, output position)."""
    x = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + position) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 29)) & (2**63 - 1)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def logprob_stats(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int):
    """Logprob and rank of `token_ids` in each row, and the top-k alternatives."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_lp, top_ids = (logprobs.topk(k, dim=1) if k > 0 else (None, None))
    return chosen, ranks, top_ids, top_lp


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """`logits` is a fresh tensor (the model's head output for these rows): modified in place."""
    lp = raw_logprobs(logits) if batch.max_logprobs >= 0 else None
    if batch.banned:  # rare (min_tokens): one indexed write, not one per row
        rows, toks = zip(*batch.banned)
        idx = torch.tensor([rows, toks]).to(logits.device, non_blocking=True)
        logits[idx[0], idx[1]] = _MASK

    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    elif batch.noise_seeds is not None and not (batch.need_top_k or batch.need_top_p or batch.need_min_p):
        tokens = _sample_gumbel(logits, batch)
    else:
        tokens = _sample_random(logits.float(), batch)

    if lp is None:
        return SamplerOutput(tokens, None, None, None, None)
    chosen, ranks, top_ids, top_lp = logprob_stats(lp, tokens, batch.max_logprobs)
    return SamplerOutput(tokens, chosen, ranks, top_ids, top_lp)


def _sample_gumbel(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Plain temperature sampling on CUDA: an exact Gumbel-max draw, no softmax (triton_sampling)."""
    from rlserve.ops.triton_sampling import gumbel_sample
    if not batch.any_greedy:  # the common case: no masking to launch
        return gumbel_sample(logits, batch.temperature, batch.noise_seeds)
    greedy = batch.temperature == 0
    temp = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    tokens = gumbel_sample(logits, temp, batch.noise_seeds)
    return torch.where(greedy, logits.argmax(dim=-1), tokens)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    temp = batch.temperature
    if batch.any_greedy:
        greedy = temp == 0
        temp = torch.where(greedy, torch.ones_like(temp), temp)
    scaled = logits / temp.unsqueeze(1)

    if batch.need_top_k or batch.need_top_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        if batch.need_top_k:
            vocab = scaled.shape[-1]
            k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab)
            kth = sorted_logits.gather(1, (k - 1).view(-1, 1))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _MASK)
        if batch.need_top_p:
            probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the mass strictly before it already reaches top_p (rows
            # with top_p = 1 keep everything, whatever the rounding of the sum).
            before = probs.cumsum(dim=-1) - probs
            drop = (before >= batch.top_p.unsqueeze(1)) & (batch.top_p < 1).unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, _MASK)
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)

    probs = scaled.softmax(dim=-1)
    if batch.need_min_p:
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < batch.min_p.unsqueeze(1) * top, 0.0)

    noise = torch.empty_like(probs)
    if not batch.seeds:
        noise.exponential_()
    elif len(batch.seeds) < noise.shape[0]:
        seeded = {row for row, _ in batch.seeds}
        unseeded = [i for i in range(noise.shape[0]) if i not in seeded]
        idx = torch.tensor(unseeded, device=noise.device)
        noise[idx] = torch.empty((len(unseeded), noise.shape[1]), device=noise.device).exponential_()
    for i, s in batch.seeds:
        gen = torch.Generator(device=noise.device).manual_seed(s)
        noise[i].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    if batch.any_greedy:
        sampled = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return sampled
