"""What the engine hands the model runner each step, and what a step gives back per token.

Named as nano-vllm's and vLLM's first engine's sequence.py, and for the same reason: these
are the values that cross from the engine (rlserve.engine) to the workers (rlserve.worker),
so they live below both. The engine fills them; the workers only read them (a worker
process of another tensor-parallel rank keeps mirrors, rlserve.worker.channel).

    Sequence          a request's tokens, and what sampling reads of it (fixed for its life)
    SamplingRow       its row of the sampler's per-row parameters
    LogitsProcessors  its logits processing beyond temperature, top-k/p and min-p
    ScheduledRequest  one sequence's chunk of a step
    SchedulerOutput   a step's batch: the chunks, in row order
    TokenLogprob      a sampled token's logprob, rank and top alternatives (TopLogprobs)
    PLACEHOLDER       the id of a token sampled by a step still in flight
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import msgspec
import numpy as np

if TYPE_CHECKING:
    from rlserve.sampling_params import SamplingParams

PLACEHOLDER = -1  # a token sampled by the step still in flight (overlapped scheduling)
ALL_LOGPROBS = 1 << 31  # as a count of alternatives, beyond any vocabulary: every token


class TopLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """A token's most likely alternatives, most likely first: a sequence of (token id,
    logprob) pairs, packed as int32 ids and float32 logprobs (the sampler's dtypes), 8 bytes
    a pair. Requests may ask for the whole vocabulary (logprobs=-1): packed, that is
    vocab_size x 8 bytes a token, in memory and on the engine's wire alike."""

    ids: bytes = b""  # int32, native byte order
    logprobs: bytes = b""  # float32

    def __len__(self) -> int:
        return len(self.ids) // 4

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return zip(memoryview(self.ids).cast("i").tolist(), memoryview(self.logprobs).cast("f").tolist())

    def __getitem__(self, index):
        return list(self)[index]

    def __repr__(self) -> str:
        pairs = self.head(4)
        more = f", ... {len(self) - 4} more" if len(self) > 4 else ""
        return f"TopLogprobs({', '.join(map(repr, pairs))}{more})"

    def head(self, k: int) -> list[tuple[int, float]]:
        """The k most likely pairs; k = -1: all of them (vLLM's "the whole vocabulary")."""
        if k < 0 or k >= len(self):
            return list(self)
        return list(zip(memoryview(self.ids)[:4 * k].cast("i").tolist(),
                        memoryview(self.logprobs)[:4 * k].cast("f").tolist()))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32, logprobs float32) as numpy arrays, without a pair per token."""
        return np.frombuffer(self.ids, dtype=np.int32), np.frombuffer(self.logprobs, dtype=np.float32)


NO_ALTERNATIVES = TopLogprobs()


class TokenLogprob(NamedTuple):
    """Logprob of one sampled token, with its rank and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: TopLogprobs  # (token_id, logprob) pairs, most likely first


class LogitsProcessors(NamedTuple):
    """A request's logits processing beyond temperature, top-k/p and min-p, prepared once
    for its life; the model runner batches the rows that have one (Sequence.processors)."""

    allowed: np.ndarray | None  # int64 token ids that keep their logits; None: all
    bias_ids: np.ndarray  # int64, with bias_values (float32): added to those logits
    bias_values: np.ndarray
    banned: np.ndarray  # int64 token ids always masked (bad words of one token)
    # Longer bad words as (the tokens before, the token masked after them)
    bad_prefixes: tuple[tuple[tuple[int, ...], int], ...]
    penalties: tuple[float, float, float] | None  # (repetition, frequency, presence); None: off

    @classmethod
    def of(cls, p: SamplingParams) -> LogitsProcessors | None:
        if not p.uses_logits_processors:
            return None
        bias = p.logit_bias or {}
        words = p.bad_words_token_ids or []
        penalties = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        return cls(
            None if p.allowed_token_ids is None else np.array(p.allowed_token_ids, dtype=np.int64),
            np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
            np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
            np.array(sorted({w[0] for w in words if len(w) == 1}), dtype=np.int64),
            tuple(sorted({(tuple(w[:-1]), w[-1]) for w in words if len(w) > 1})),
            None if penalties == (1.0, 0.0, 0.0) else penalties)


class SamplingRow(NamedTuple):
    """A request's row of the sampler's per-row parameters (rlserve.worker.sampling_inputs
    reads a batch's rows as one float table, a column per field)."""

    temperature: float
    top_p: float
    min_p: float
    top_k: int  # 0: off
    seeded: bool
    min_tokens: int
    logprobs: int  # alternatives asked for; ALL_LOGPROBS: the whole vocabulary; -1: no logprobs
    has_processors: bool

    @classmethod
    def of(cls, p: SamplingParams, has_processors: bool) -> SamplingRow:
        # A top_k beyond any vocabulary means all of it, as 0 does. Greedy rows drop
        # top-k/p and min-p, as vLLM does: they cannot change the argmax, and processed
        # logprobs of a greedy row are those of its processed logits at temperature 1.
        greedy = p.temperature == 0
        return cls(p.temperature, 1.0 if greedy else p.top_p, 0.0 if greedy else p.min_p,
                   0 if greedy else min(max(p.top_k, 0), 1 << 31), p.seed is not None, p.min_tokens,
                   # Chosen tokens are read out of the whole vocabulary's logprobs.
                   -1 if p.logprobs is None else ALL_LOGPROBS if p.logprobs == -1 or p.logprob_token_ids
                   else p.logprobs,
                   has_processors)


@dataclass(eq=False)  # identity: the scheduler's queues and the runner's caches compare by it
class Sequence:
    """One sequence being generated: its tokens, how many of them have their KV computed,
    and what sampling reads of it. The engine's Request (rlserve.engine.request) is a
    Sequence with the scheduler's and the outputs' state added; the model runner reads
    only what is here."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    sample_index: int = 0  # which of a prompt's n samples (its seed differs by it)
    lora_slot: int = -1  # the slot its LoRA adapter's weights sit in; -1: the base model
    state_slot: int = -1  # a hybrid model's: its slot of the linear-attention state pool; -1: none

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)  # prompt, then output
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Fixed for the request's life, read for every token: computed once.
        p = self.sampling_params
        # Tokens that can end the request (subject to min_tokens).
        self.stop_ids = frozenset(p.stop_token_ids or ()).union(() if p.ignore_eos else self.eos_token_ids)
        self.processors = LogitsProcessors.of(p)
        self.sampling_row = SamplingRow.of(p, self.processors is not None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class ScheduledRequest:
    request: Sequence
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens: a token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    """A step's batch: the scheduled chunks, in the order of the runner's rows."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    # Requests that finished since the last step that ran (vLLM's finished_req_ids):
    # workers of other ranks drop their mirrors of them.
    finished_ids: list[str] = field(default_factory=list)
    # A hybrid model's prefix cache: (from, to) state slots copied before the forward pass
    # (a cached state into a request's slot) and after it (a request's into the cache)
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled
