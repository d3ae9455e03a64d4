"""Sampling from a batch of logits, one row per request, with per-row parameters.

The logits go through vLLM's order: a structured output's grammar mask (a packed bitmask,
rlserve.engine.structured_output), the allow-list, bans (bad words, stop tokens below
min_tokens) and logit bias, then the penalties (LogitsProcessing, all in float32), then
temperature, min-p, top-k and top-p. Each step is a handful of batched tensor operations
over the rows that use it, and nothing at all when no row does.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws from p
exactly and lets each seeded row take its noise from its own generator, so a seeded
request gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_MASK = float("-inf")


@dataclass
class Penalties:
    """The rows with a repetition, frequency or presence penalty, and their token history.

    `counts` and `prompt_mask` are built on the device (see rlserve.worker.penalties), so
    a token the previous step is still sampling counts without the host waiting for it.
    """

    rows: torch.Tensor | None  # [P] int64 rows of the batch; None: all of them, in order
    repetition: torch.Tensor  # [P, 1] float32, 1 = off
    frequency: torch.Tensor  # [P, 1] float32
    presence: torch.Tensor  # [P, 1] float32
    counts: torch.Tensor  # [P, V] float32: occurrences of each token in the row's output
    prompt_mask: torch.Tensor | None  # [P, V] bool: the prompt's tokens (None: no repetition penalty)
    any_repetition: bool
    any_frequency: bool
    any_presence: bool


@dataclass
class LogitsProcessing:
    """Per-row changes to the logits before temperature; only the parts some row uses are set."""

    last_tokens: torch.Tensor  # [R] each row's newest token, on the device
    # (rows with an allow-list, then the (row, token) pairs that keep their logit)
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    bans: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, token) pairs masked out
    # Per ban: the ban holds only if the row's newest token is this one (the end of a
    # longer bad word, which may still be in flight on the host's side); -1: always.
    # None: every ban always holds.
    ban_after: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (row, token, bias)
    penalties: Penalties | None = None


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, as tensors on the logits' device."""

    temperature: torch.Tensor  # [R] float32, 0 = greedy
    top_p: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64, 0 = off
    min_p: torch.Tensor  # [R] float32
    seeds: list[tuple[int, int]]  # (row, seed already mixed with the step) of seeded rows, in row order
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_logprobs: int  # the most alternatives any row asked for (beyond the vocabulary: all); -1 = none
    # On CUDA: one Philox key per row (the request's per-token seed, or a fresh random one),
    # which selects the fused Gumbel-max path for plain temperature sampling.
    noise_seeds: torch.Tensor | None = None
    processing: LogitsProcessing | None = None
    # Logprobs of the distribution sampled from (after processing, temperature, min-p,
    # top-k/p; greedy rows at temperature 1) instead of the model's raw one.
    processed_logprobs: bool = False
    # Structured outputs: [G, ceil(V / 32)] int32, bit j % 32 of word j // 32 allows token
    # j, for rows `token_bitmask_rows` ([G] int64; None: every row, in order).
    token_bitmask: torch.Tensor | None = None
    token_bitmask_rows: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None  # [R] logprob of each sampled token (raw or processed)
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


# Per row: the logprob and rank of a token, and the top alternatives' ids and logprobs (None: k = 0).
LogprobStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def logprob_stats(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobStats:
    """Logprob and rank of `token_ids` in each row, and the top-k alternatives (k = -1, or
    a k beyond the vocabulary: all of them, most likely first)."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    vocab = logprobs.shape[1]
    k = vocab if k < 0 or k > vocab else k
    top_lp, top_ids = logprobs.topk(k, dim=1) if k > 0 else (None, None)
    return chosen, ranks, top_ids, top_lp


def sample(
    logits: torch.Tensor, batch: SamplingBatch, gumbel: Callable[..., torch.Tensor] | None = None
) -> SamplerOutput:
    """`logits` is a fresh tensor (the model's head output for these rows): modified in place.
    `gumbel`: the kernel set's Gumbel-max sampler, for rows with noise seeds."""
    want_logprobs = batch.max_logprobs >= 0
    lp = raw_logprobs(logits) if want_logprobs and not batch.processed_logprobs else None
    if batch.processing is not None or batch.token_bitmask is not None:
        logits = logits.float()  # a copy unless float32 already
        if batch.token_bitmask is not None:
            apply_token_bitmask(logits, batch.token_bitmask, batch.token_bitmask_rows)
        if batch.processing is not None:
            apply_processing(logits, batch.processing)

    processed = None  # the logits sampled from, where a path has them
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
        processed = logits
    elif (
        gumbel is not None
        and batch.noise_seeds is not None
        and not (batch.need_top_k or batch.need_top_p or batch.need_min_p)
    ):
        tokens = _sample_gumbel(logits, batch, gumbel)
    else:
        tokens, processed = _sample_random(logits.float(), batch)

    if not want_logprobs:
        return SamplerOutput(tokens, None, None, None, None)
    if lp is None:
        if processed is None:
            processed = logits.float() / _temperature(batch).unsqueeze(1)
        lp = raw_logprobs(processed)
    chosen, ranks, top_ids, top_lp = logprob_stats(lp, tokens, batch.max_logprobs)
    return SamplerOutput(tokens, chosen, ranks, top_ids, top_lp)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Mask, in place, every token whose bit is 0 in its row of the packed bitmask."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    if rows is None:
        logits.masked_fill_(allowed == 0, _MASK)
    else:
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(allowed == 0, _MASK))


def apply_processing(logits: torch.Tensor, proc: LogitsProcessing) -> None:
    """The allow-list, bans, bias and penalties, in place on float32 logits [R, V]."""
    if proc.allowed is not None:
        allowed_rows, rows, toks = proc.allowed
        keep = logits[rows, toks]
        logits.index_fill_(0, allowed_rows, _MASK)
        logits[rows, toks] = keep
    if proc.bans is not None:
        rows, toks = proc.bans
        if proc.ban_after is None:
            logits[rows, toks] = _MASK
        else:
            # Adding -inf or 0, so a (row, token) that two bans name is masked if either holds.
            holds = (proc.ban_after < 0) | (proc.last_tokens[rows] == proc.ban_after)
            logits.index_put_((rows, toks), torch.where(holds, _MASK, 0.0), accumulate=True)
    if proc.bias is not None:
        rows, toks, bias = proc.bias
        logits.index_put_((rows, toks), bias, accumulate=True)
    if proc.penalties is not None:
        _apply_penalties(logits, proc.penalties)


def _apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
    x = logits if pen.rows is None else logits.index_select(0, pen.rows)
    counts = pen.counts
    if pen.any_repetition:
        seen = counts > 0
        if pen.prompt_mask is not None:
            seen |= pen.prompt_mask
        rep = pen.repetition
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if pen.any_frequency:
        x = x - pen.frequency * counts
    if pen.any_presence:
        x = x - pen.presence * (counts > 0)
    if pen.rows is not None:
        logits.index_copy_(0, pen.rows, x)
    elif x is not logits:
        logits.copy_(x)


def _temperature(batch: SamplingBatch) -> torch.Tensor:
    """Each row's temperature, greedy rows at 1 (they take the argmax anyway)."""
    if not batch.any_greedy:
        return batch.temperature
    return torch.where(batch.temperature == 0, torch.ones_like(batch.temperature), batch.temperature)


def _sample_gumbel(logits: torch.Tensor, batch: SamplingBatch, gumbel: Callable) -> torch.Tensor:
    """Plain temperature sampling: an exact Gumbel-max draw, no softmax (triton_sampling)."""
    if not batch.any_greedy:  # the common case: no masking to launch
        return gumbel(logits, batch.temperature, batch.noise_seeds)
    tokens = gumbel(logits, _temperature(batch), batch.noise_seeds)
    return torch.where(batch.temperature == 0, logits.argmax(dim=-1), tokens)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from temperature, min-p, top-k and top-p in that order (vLLM's); returns the
    tokens and the logits they were drawn from."""
    scaled = logits / _temperature(batch).unsqueeze(1)

    if batch.need_min_p:
        # Drop tokens less likely than min_p times the most likely one: a logit below the
        # largest plus log(min_p) (min_p = 0 gives -inf, which drops nothing).
        top = scaled.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(scaled < top + batch.min_p.log().unsqueeze(1), _MASK)

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
        sampled = torch.where(batch.temperature == 0, logits.argmax(dim=-1), sampled)
    return sampled, scaled
