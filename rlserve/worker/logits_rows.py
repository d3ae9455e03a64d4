"""The rows of a step's hidden states that need logits: each sampling row's last token,
and, for a request that wants prompt logprobs, its prompt positions; padded to the sizes
of the decode graphs' LM head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from rlserve.sequence import ScheduledRequest, Sequence

if TYPE_CHECKING:
    from rlserve.worker.cuda_graphs import CudaGraphs


class LogitsPlan(NamedTuple):
    """The rows that need logits, and those that sample (see logits_plan)."""

    logits_indices: np.ndarray  # int64 rows of the hidden states, padded (see CudaGraphs.lm_head_rows)
    num_logits: int  # the rows that need logits: the first num_logits of logits_indices
    identity: bool  # the rows needing logits are the hidden states' first num_logits
    sample_rows: list[int]  # index into logits_indices of each sampling request
    sample_requests: list  # ScheduledRequest that sample, aligned with sample_rows
    requests: list  # the Sequence of each sample_requests item
    prompt_rows: dict[str, tuple[int, list[int]]]  # req id -> (first logits row, target ids)
    sample_index: np.ndarray | None  # sample_rows, when not every logits row samples


def logits_plan(
    items: list[ScheduledRequest],
    reqs: list[Sequence],
    qsl: np.ndarray,
    seq_lens: np.ndarray,
    num_tokens: int,
    totals: list[int],
    any_prompt_logprobs: bool,
    graphs: CudaGraphs | None,
) -> LogitsPlan:
    """The rows of the hidden states that need logits, and which of them sample. `qsl`:
    query start locations, `seq_lens`: each sequence's length once this step is computed,
    `totals`: its tokens so far; `graphs`: the decode graphs, whose sizes the rows are
    padded to."""
    num_seqs = len(reqs)
    # The chunk reaches the end of the sequence's tokens.
    samples = seq_lens == np.fromiter(totals, dtype=np.int64, count=num_seqs)
    sample_index = None  # rows of the logits that sample, when not all of them do
    if any_prompt_logprobs:
        logits_indices, sample_rows, sample_requests, prompt_rows = _logits_rows(items, qsl.tolist(), samples.tolist())
        sample_reqs = [item.request for item in sample_requests]
        if len(sample_rows) != len(logits_indices):
            sample_index = np.array(sample_rows, dtype=np.int64)
    else:  # only the sampling rows need logits: each chunk's last token
        logits_indices = qsl[1:][samples] - 1
        if len(logits_indices) == num_seqs:
            sample_requests, sample_reqs = items, reqs
        else:
            rows = np.flatnonzero(samples).tolist()
            sample_requests, sample_reqs = [items[i] for i in rows], [reqs[i] for i in rows]
        sample_rows = list(range(len(sample_requests)))
        prompt_rows = {}
    indices = np.asarray(logits_indices, dtype=np.int64)
    n = indices.size
    identity = n == num_tokens and bool((indices == np.arange(n)).all())
    padded = n if graphs is None else graphs.lm_head_rows(n)
    if padded > n:  # repeats of a real row: computed, then dropped
        indices = np.concatenate([indices, np.full(padded - n, indices[-1], dtype=np.int64)])
    return LogitsPlan(indices, n, identity, sample_rows, sample_requests, sample_reqs, prompt_rows, sample_index)


def _logits_rows(
    items: list[ScheduledRequest], qsl: list[int], samples: list[bool]
) -> tuple[list[int], list[int], list[ScheduledRequest], dict[str, tuple[int, list[int]]]]:
    """Which rows need logits when some request wants prompt logprobs: its prompt
    positions (position p predicts token p + 1), then each sampling row."""
    logits_indices: list[int] = []
    sample_rows: list[int] = []
    sample_requests: list[ScheduledRequest] = []
    prompt_rows: dict[str, tuple[int, list[int]]] = {}
    for row, item in enumerate(items):
        req = item.request
        start, flat = req.num_computed_tokens, qsl[row]
        end = start + item.num_new_tokens
        if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens:
            # The prompt's first token has no logprob.
            last = min(end, req.num_prompt_tokens - 1)
            if last > start:
                prompt_rows[req.request_id] = (len(logits_indices), req.token_ids[start + 1 : last + 1])
                logits_indices.extend(range(flat, flat + last - start))
        if samples[row]:
            sample_rows.append(len(logits_indices))
            sample_requests.append(item)
            logits_indices.append(qsl[row + 1] - 1)
    return logits_indices, sample_rows, sample_requests, prompt_rows
