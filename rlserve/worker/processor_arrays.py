"""A batch's logits processing as host arrays (sampler.LogitsProcessing has the device side):
what depends only on its requests' logits processors (Request.processors: allow-lists,
biases, banned tokens, penalties), batched once for the rows that have any, and the tokens
banned this step (stop tokens below min_tokens, bad words).
"""

from __future__ import annotations

from typing import Generic, NamedTuple

import numpy as np

from rlserve.worker.upload import ArrayT


class AllowArrays(NamedTuple, Generic[ArrayT]):
    """The allow-lists of a batch's rows (int64), in sampler.LogitsProcessing.allowed's order."""

    rows: ArrayT  # rows with an allow-list
    pair_rows: ArrayT  # (row, token) pairs that keep their logit
    pair_tokens: ArrayT


class BiasArrays(NamedTuple, Generic[ArrayT]):
    """(row, token) int64, bias float32: added to that logit (sampler.LogitsProcessing.bias)."""

    rows: ArrayT
    tokens: ArrayT
    values: ArrayT


class PenaltyArrays(NamedTuple, Generic[ArrayT]):
    """The penalty rows' parameters (sampler.Penalties)."""

    repetition: ArrayT  # float32 per penalty row
    frequency: ArrayT
    presence: ArrayT
    rows: ArrayT | None  # int64 rows with penalties; None: every row, in order


class ProcessorArrays(NamedTuple, Generic[ArrayT]):
    """A batch's logits-processor arrays that depend only on its requests; None where no
    row uses that part."""

    allowed: AllowArrays[ArrayT] | None
    bias: BiasArrays[ArrayT] | None
    penalties: PenaltyArrays[ArrayT] | None


class BanArrays(NamedTuple, Generic[ArrayT]):
    """The tokens masked this step (int64), see `step_bans`."""

    rows: ArrayT  # (row, token) masked
    tokens: ArrayT
    after: ArrayT | None  # per ban (see sampler.LogitsProcessing.ban_after); None: all hold


class BatchProcessors(NamedTuple):
    """The logits processors of a batch's rows (Request.processors), as host arrays: what
    depends only on the requests (see `batch_processors`)."""

    arrays: ProcessorArrays[np.ndarray] | None  # uploaded with every step
    banned_rows: np.ndarray  # int64, with banned_tokens: masked in every step
    banned_tokens: np.ndarray
    bad_word_rows: list[int]  # rows with bad words of several tokens (checked per step)
    penalty_requests: list  # the Request of each penalty row
    needs_prompt: np.ndarray  # bool per penalty row: it has a repetition penalty
    any_frequency: bool
    any_presence: bool


def batch_processors(reqs: list, rows: list[int]) -> BatchProcessors:
    """Batch the logits processors of `rows` (the rows whose request has any)."""

    def rows_of(i: int, ids: np.ndarray) -> np.ndarray:
        return np.full(ids.size, i, dtype=np.int64)

    def cat(parts: list[np.ndarray], dtype: type[np.generic] = np.int64) -> np.ndarray:
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

    allowed_rows, allowed_r, allowed_t, bias_r, bias_t, bias_v, ban_r, ban_t = ([] for _ in range(8))
    bad_word_rows, penalty_rows, penalties = [], [], []
    for i in rows:
        proc = reqs[i].processors
        if proc.allowed is not None:
            allowed_rows.append(i)
            allowed_r.append(rows_of(i, proc.allowed))
            allowed_t.append(proc.allowed)
        if proc.bias_ids.size:
            bias_r.append(rows_of(i, proc.bias_ids))
            bias_t.append(proc.bias_ids)
            bias_v.append(proc.bias_values)
        if proc.banned.size:
            ban_r.append(rows_of(i, proc.banned))
            ban_t.append(proc.banned)
        if proc.bad_prefixes:
            bad_word_rows.append(i)
        if proc.penalties is not None:
            penalty_rows.append(i)
            penalties.append(proc.penalties)
    allowed = (
        AllowArrays(np.array(allowed_rows, dtype=np.int64), cat(allowed_r), cat(allowed_t)) if allowed_rows else None
    )
    bias = BiasArrays(cat(bias_r), cat(bias_t), cat(bias_v, np.float32)) if bias_r else None
    pen = np.array(penalties, dtype=np.float32).reshape(-1, 3)  # repetition, frequency, presence
    pen_arrays: PenaltyArrays[np.ndarray] | None = None
    if penalty_rows:
        pen_arrays = PenaltyArrays(
            pen[:, 0].copy(),
            pen[:, 1].copy(),
            pen[:, 2].copy(),
            np.array(penalty_rows, dtype=np.int64) if len(penalty_rows) < len(reqs) else None,
        )
    arrays = ProcessorArrays(allowed, bias, pen_arrays) if allowed_rows or bias_r or penalty_rows else None
    return BatchProcessors(
        arrays,
        cat(ban_r),
        cat(ban_t),
        bad_word_rows,
        [reqs[i] for i in penalty_rows],
        pen[:, 0] != 1,
        bool((pen[:, 1] != 0).any()),
        bool((pen[:, 2] != 0).any()),
    )


def step_bans(requests: list, min_tokens_rows: list[int], proc: BatchProcessors | None) -> BanArrays[np.ndarray] | None:
    """The tokens masked this step as (rows, tokens, after) (None: no ban): stop tokens in
    rows still below min_tokens, and bad words. Only rows that have them are looked at.

    A bad word of several tokens is masked when the output ends with all but its last
    token. The newest of those may still be in flight (a placeholder): the host checks
    the older ones and the device the newest (`ban_after`)."""
    ban_rows: list[int] = []
    toks: list[int] = []
    after: list[int] = []
    for i in min_tokens_rows:
        req = requests[i]
        if len(req.token_ids) - req.num_prompt_tokens < req.sampling_params.min_tokens:
            ban_rows.extend(i for _ in req.stop_ids)  # what could end it too early
            toks.extend(req.stop_ids)
    for i in proc.bad_word_rows if proc is not None else ():
        req = requests[i]
        tokens, n = req.token_ids, len(req.token_ids)
        num_output = n - req.num_prompt_tokens
        for prefix, last in req.processors.bad_prefixes:
            k = len(prefix)
            if k <= num_output and tuple(tokens[n - k : n - 1]) == prefix[:-1]:
                ban_rows.append(i)
                toks.append(last)
                after.append(prefix[-1])
    static = proc if proc is not None and proc.banned_rows.size else None  # bans that hold every step
    if not ban_rows and static is None:
        return None
    ban_r, ban_t = np.array(ban_rows, dtype=np.int64), np.array(toks, dtype=np.int64)
    ban_after = None
    if after:  # the unconditional ones first, then those that wait for the newest token
        unconditional = len(ban_rows) - len(after)
        ban_after = np.array([-1] * unconditional + after, dtype=np.int64)
    if static is not None:
        ban_r = np.concatenate([static.banned_rows, ban_r])
        ban_t = np.concatenate([static.banned_tokens, ban_t])
        if after:
            ban_after = np.concatenate([np.full(static.banned_rows.size, -1, dtype=np.int64), ban_after])
    return BanArrays(ban_r, ban_t, ban_after)
