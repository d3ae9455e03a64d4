"""The token history penalties need, kept on the device from one step to the next.

A repetition penalty needs each row's prompt tokens and output tokens as sets, frequency
and presence penalties the output tokens' counts. Both live here as dense [rows, vocab]
tensors (output counts in float32, the prompt as a bool mask), built on the device by a
scatter over the row's token ids, and only for the rows that have a penalty.

From one step to the next a row gains one token, the one the previous step sampled. With
overlapped scheduling the host does not know it yet (the request holds a PLACEHOLDER), but
the device does: it is the row's newest input token. So the host uploads only tokens it
knows, a row's newest token is always added on the device (`last_tokens`), and in the
steady state of decoding (the same rows as the step before) a step adds one count per row
in place, uploading nothing but the row indices.
"""

from __future__ import annotations

from typing import Generic, NamedTuple

import numpy as np
import torch

from rlserve.worker.upload import ArrayT


class RebuildArrays(NamedTuple, Generic[ArrayT]):
    """What a step adds when its rows are not the ones the tensors hold (int64)."""

    dst: ArrayT  # rows that carry over: row dst[i] is the old tensors' src[i]
    src: ArrayT
    out_rows: ArrayT  # (row, token) of the known output tokens not counted yet
    out_tokens: ArrayT
    prompt_rows: ArrayT  # (row, token) of prompts entering the mask
    prompt_tokens: ArrayT


class HistoryArrays(NamedTuple, Generic[ArrayT]):
    """The token ids and rows `PenaltyHistory.build` adds this step: host arrays in the
    step's upload, then device tensors."""

    add_last: ArrayT  # int64 rows whose newest token is added on the device
    rebuild: RebuildArrays[ArrayT] | None  # None: the same rows as the tensors hold, added to in place


class PenaltyPlan(NamedTuple):
    """What `PenaltyHistory.build` does on the device this step, as host arrays to upload."""

    arrays: HistoryArrays[np.ndarray]  # uploaded with the step
    needs_prompt: np.ndarray  # bool per row: has a repetition penalty


class PenaltyHistory:
    """Output-token counts and prompt masks of the penalty rows, across steps."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.reset()

    def reset(self) -> None:
        """Forget everything (and give the device memory back)."""
        self.requests: list = []  # the Request of each row the tensors hold, in order
        self.counted = np.zeros(0, dtype=np.int64)  # per row: its tokens [0, counted) are in
        self.counts: torch.Tensor | None = None  # [rows, vocab] float32
        self.prompt_mask: torch.Tensor | None = None  # [rows, vocab] bool

    def plan(self, reqs: list, needs_prompt: np.ndarray) -> PenaltyPlan:
        """Host side, before the step's upload: which rows carry over, and the tokens to add.

        Only a row's newest token can be a placeholder (one step in flight at most); it is
        added on the device, every older one from the host.
        """
        num_tokens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        if reqs == self.requests:  # Request compares by identity
            gained = num_tokens - self.counted
            if ((gained == 0) | (gained == 1)).all():
                self.counted = num_tokens
                return PenaltyPlan(HistoryArrays(np.flatnonzero(gained), None), needs_prompt)

        old_rows = {id(r): i for i, r in enumerate(self.requests)}
        dst, src, add_last = [], [], []
        out_rows, out_tokens, prompt_rows, prompt_tokens = [], [], [], []
        for j, req in enumerate(reqs):
            n = int(num_tokens[j])
            i = old_rows.get(id(req))
            if i is not None and self.counted[i] <= n:
                dst.append(j)
                src.append(i)
                start = int(self.counted[i])
                prompt_known = self.prompt_mask is not None or not needs_prompt[j]
            else:
                start = req.num_prompt_tokens  # a fresh row: no output counted yet
                prompt_known = not needs_prompt[j]
            if not prompt_known:
                prompt_rows.append(np.full(req.num_prompt_tokens, j, dtype=np.int64))
                prompt_tokens.append(np.asarray(req.prompt_token_ids, dtype=np.int64))
            if n - 1 > start:  # known tokens between the counted ones and the newest
                known = np.asarray(req.token_ids[start : n - 1], dtype=np.int64)
                if (known < 0).any():
                    raise RuntimeError(f"request {req.request_id}: a token other than its newest is still unknown")
                out_rows.append(np.full(known.size, j, dtype=np.int64))
                out_tokens.append(known)
            if n - 1 >= start:
                add_last.append(j)
        self.requests = list(reqs)
        self.counted = num_tokens

        def cat(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        rebuild = RebuildArrays(
            dst=np.array(dst, dtype=np.int64),
            src=np.array(src, dtype=np.int64),
            out_rows=cat(out_rows),
            out_tokens=cat(out_tokens),
            prompt_rows=cat(prompt_rows),
            prompt_tokens=cat(prompt_tokens),
        )
        return PenaltyPlan(HistoryArrays(np.array(add_last, dtype=np.int64), rebuild), needs_prompt)

    def build(
        self, plan: PenaltyPlan, t: HistoryArrays[torch.Tensor], last_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Device side: the rows' counts and prompt masks this step. `t`: the plan's arrays
        on the device; `last_tokens` [rows]: each row's newest token."""
        add_last, r = t.add_last, t.rebuild
        if r is None:
            assert self.counts is not None  # `plan` found the rows these tensors were built for
            self._add(self.counts, add_last, last_tokens[add_last])
            return self.counts, self.prompt_mask
        rows = len(plan.needs_prompt)
        counts = torch.zeros((rows, self.vocab_size), dtype=torch.float32, device=self.device)
        if self.counts is not None and r.dst.numel():
            counts.index_copy_(0, r.dst, self.counts.index_select(0, r.src))
        self._add(counts, r.out_rows, r.out_tokens)
        self._add(counts, add_last, last_tokens[add_last])
        mask = None
        if plan.needs_prompt.any():
            mask = torch.zeros((rows, self.vocab_size), dtype=torch.bool, device=self.device)
            if self.prompt_mask is not None and r.dst.numel():
                mask.index_copy_(0, r.dst, self.prompt_mask.index_select(0, r.src))
            mask[r.prompt_rows, r.prompt_tokens] = True
        self.counts, self.prompt_mask = counts, mask
        return counts, mask

    @staticmethod
    def _add(counts: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        counts.index_put_(
            (rows, tokens), torch.ones(rows.shape, dtype=counts.dtype, device=counts.device), accumulate=True
        )
