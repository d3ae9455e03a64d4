"""Requests waiting for their grammar (structured outputs): a spec is checked when the
request arrives (a bad one is a 400), compiled on a thread, and the request joins the
scheduler's queue once its grammar is ready. xgrammar is imported at the first grammar, so
an engine that never sees one never loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from rlserve.engine.request import Request, RequestStatus
from rlserve.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from rlserve.wire.outputs import Rejected

if TYPE_CHECKING:
    from concurrent.futures import Future

    from transformers import PreTrainedTokenizerBase

    from rlserve.config import GrammarLimits
    from rlserve.engine.structured_output import CompiledGrammar, StructuredOutputCompiler


class GrammarWait:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        limits: GrammarLimits,
    ) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids, self.limits = tokenizer, vocab_size, eos_token_ids, limits
        self.waiting: list[Request] = []
        self._compiler: StructuredOutputCompiler | None = None  # made at the first grammar

    def __len__(self) -> int:
        return len(self.waiting)

    def compile(self, spec: StructuredOutputsParams, params: SamplingParams) -> Future[CompiledGrammar]:
        """Check a spec now (InvalidRequestError if bad) and start compiling it on a thread."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "structured_outputs: needs the tokenizer, which this engine was started without", "structured_outputs"
            )
        if params.min_tokens:  # a finished grammar may allow nothing but its end
            raise InvalidRequestError("min_tokens: cannot be combined with structured outputs", "min_tokens")
        if self._compiler is None:
            from rlserve.engine.structured_output import StructuredOutputCompiler

            self._compiler = StructuredOutputCompiler(
                self.tokenizer, self.vocab_size, self.eos_token_ids, limits=self.limits
            )
        self._compiler.validate(spec)
        return self._compiler.compile(spec)

    def add(self, req: Request) -> None:
        """A request whose grammar (`req.grammar`, from `compile`) is still compiling."""
        self.waiting.append(req)

    def admit_ready(self, rejected: list[Rejected], enqueue: Callable[[Request], None]) -> None:
        """Requests whose grammar is ready are enqueued with their matcher; one whose
        grammar failed to compile is refused (once per prompt)."""
        compiler = self._compiler
        assert compiler is not None  # it compiles the grammars these requests wait for
        ready = [(r, g) for r in self.waiting if (g := r.grammar) is not None and g.done()]
        for req, grammar in ready:
            self.waiting.remove(req)
            error = grammar.exception()
            if error is not None:
                req.status = RequestStatus.FINISHED
                if req.sample_index == 0:
                    rejected.append(
                        Rejected(
                            req.group_id or req.request_id, str(error), getattr(error, "param", "structured_outputs")
                        )
                    )
                continue
            req.matcher = compiler.matcher(grammar.result())
            enqueue(req)

    def take(self, request_id: str) -> Request | None:
        """Take a waiting request out (an abort); its grammar stops compiling if no other
        request waits for it."""
        req = next((r for r in self.waiting if r.request_id == request_id), None)
        if req is None:
            return None
        self.waiting.remove(req)
        if not any(r.grammar is req.grammar for r in self.waiting):
            spec = req.sampling_params.structured_outputs
            assert self._compiler is not None and spec is not None  # req waited for its grammar
            self._compiler.abandon(spec)  # nobody waits
        return req

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
