"""A step's logprobs: the prompt's, computed on the device in slices of rows, and every
row's packed on the host into a TokenLogprob (the chosen token's logprob and rank, and the
alternatives the request asked for).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from rlserve.model.base import CausalLM
from rlserve.sequence import NO_ALTERNATIVES, ScheduledRequest, SchedulerOutput, TokenLogprob, TopLogprobs
from rlserve.worker import sampler as S
from rlserve.worker.step_inputs import BatchInputs

# Prompt logprobs: logits elements (rows x vocabulary) computed at once, about 256 MiB in float32.
_PROMPT_LOGITS_ELEMENTS = 1 << 26

PromptRows = tuple[list[int], int, S.LogprobStats]  # a prompt's targets, k, and device stats


def prompt_logprobs(
    model: CausalLM, sched: SchedulerOutput, batch: BatchInputs, hidden: torch.Tensor
) -> tuple[torch.Tensor, dict[str, PromptRows], dict[str, int]]:
    """The sampling rows' logits, and each prompt's logprob stats computed in slices of
    rows, so that a long chunk's logits never sit on the device whole (the memory
    profile measures one slice)."""
    index = batch.logits_indices[: batch.num_logits]
    assert batch.sample_index is not None  # prompt rows are logits rows that do not sample
    rows_logits = model.compute_logits(hidden[index[batch.sample_index]])
    step = max(1, _PROMPT_LOGITS_ELEMENTS // model.config.vocab_size)
    prompt: dict[str, PromptRows] = {}
    prompt_start: dict[str, int] = {}
    for rid, (first, targets) in batch.prompt_rows.items():
        req = next(it.request for it in sched.scheduled if it.request.request_id == rid)
        k = req.sampling_params.prompt_logprobs
        assert k is not None  # prompt_rows holds the requests that asked for prompt logprobs
        ids = torch.tensor(targets, device=hidden.device)
        parts = []
        for s in range(0, len(targets), step):
            rows = index[first + s : first + min(s + step, len(targets))]
            parts.append(S.logprob_stats(S.raw_logprobs(model.compute_logits(hidden[rows])), ids[s : s + step], k))
        stats = (
            torch.cat([p[0] for p in parts]),
            torch.cat([p[1] for p in parts]),
            _cat([p[2] for p in parts]),
            _cat([p[3] for p in parts]),
        )
        prompt[rid] = (targets, k, stats)
        prompt_start[rid] = req.num_computed_tokens
    return rows_logits, prompt, prompt_start


def sampled_logprobs(
    out: S.SamplerOutput, tokens: list[int], items: list[ScheduledRequest]
) -> list[TokenLogprob | None]:
    """The sampling rows' TokenLogprob (None where a row asked for no logprobs); rows that
    named their tokens (logprob_token_ids) get those tokens' logprobs as alternatives."""
    if out.logprobs is None:
        return [None] * len(tokens)
    assert out.ranks is not None  # computed with the logprobs
    params = [it.request.sampling_params for it in items]
    ks = [-1 if p.logprob_token_ids else p.logprobs for p in params]
    packed = pack_logprobs(tokens, out.logprobs, out.ranks, out.top_ids, out.top_logprobs, ks)
    for i, p in enumerate(params):
        lp = packed[i]
        if p.logprob_token_ids and lp is not None:
            packed[i] = lp._replace(top=_chosen(lp.top, p.logprob_token_ids))
    return packed


def pack_logprobs(
    tokens: list[int],
    chosen: torch.Tensor,
    ranks: torch.Tensor,
    top_ids: torch.Tensor | None,
    top_lp: torch.Tensor | None,
    ks: list[int | None],
) -> list[TokenLogprob | None]:
    """Each row's TokenLogprob; `ks`: per row, the alternatives it asked for (None: no
    logprobs; -1: all the step computed, the whole vocabulary)."""
    chosen_lps, chosen_ranks = chosen.tolist(), ranks.tolist()
    width = 0 if top_ids is None else top_ids.shape[1]
    if width:  # the step's alternatives packed once; each row takes its slice
        assert top_ids is not None and top_lp is not None  # computed together
        ids = top_ids.numpy().astype(np.int32).tobytes()
        lps = top_lp.numpy().astype(np.float32, copy=False).tobytes()
    result: list[TokenLogprob | None] = []
    for i, (tok, k) in enumerate(zip(tokens, ks)):
        if k is None:
            result.append(None)
            continue
        top = NO_ALTERNATIVES
        if k and width:
            start = 4 * width * i
            end = start + 4 * (width if k < 0 else min(k, width))
            top = TopLogprobs(ids[start:end], lps[start:end])
        result.append(TokenLogprob(tok, chosen_lps[i], chosen_ranks[i], top))
    return result


def _chosen(whole: TopLogprobs, token_ids: list[int]) -> TopLogprobs:
    """The logprobs of `token_ids`, in that order, out of the whole vocabulary's."""
    ids, lps = whole.arrays()
    by_id = np.empty(int(ids.max()) + 1, dtype=np.float32)
    by_id[ids] = lps
    wanted = np.asarray(token_ids, dtype=np.int32)
    return TopLogprobs(wanted.tobytes(), by_id[wanted].tobytes())


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(cast(list[torch.Tensor], parts))
