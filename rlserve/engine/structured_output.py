"""Structured outputs with xgrammar: grammars compiled off the step loop, one matcher per
request, and the packed token bitmask the sampler applies on the device.

How the engine core uses it (one StructuredOutputCompiler per engine):

    admission   compiler.validate(spec)             a bad spec is a 400, before anything runs
                req.grammar = compiler.compile(spec)  a Future, compiled in a thread pool and
                                                      cached by spec
    scheduling  a request whose future is not done() is not scheduled yet (its first sampled
                token needs the mask); a future that failed finishes it with the error
    each step   matcher = compiler.matcher(req.grammar.result()), once, at its first step
                (see `fill_bitmask` and ModelRunner.sample for where the mask goes)
    each token  matcher.accept([token]); False means the token broke the grammar (cannot
                happen for a token sampled under the mask, except one sampled while
                overlapped scheduling had no mask yet); matcher.is_terminated(): the grammar
                took its stop token, the request is done

xgrammar holds the C++ state; these types keep the engine's side small and typed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, NamedTuple, Sequence

import torch

from rlserve.sampling_params import InvalidRequestError, StructuredOutputsParams

BITMASK_WORD_BITS = 32  # a packed int32 bitmask: bit j % 32 of word j // 32 allows token j


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // BITMASK_WORD_BITS)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, bitmask_width] int32 on the host, every token allowed (all bits set)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


class CompiledGrammar(NamedTuple):
    spec: StructuredOutputsParams
    compiled: object  # xgrammar.CompiledGrammar


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, grammar: CompiledGrammar):
        import xgrammar as xgr
        self.grammar = grammar
        self._matcher = xgr.GrammarMatcher(grammar.compiled)
        self.num_accepted = 0  # tokens accepted so far (what rollback can undo)

    def accept(self, tokens: Iterable[int]) -> bool:
        """Advance over `tokens`; False at the first one the grammar refuses (the tokens
        before it stay accepted)."""
        for token in tokens:
            if not self._matcher.accept_token(int(token)):
                return False
            self.num_accepted += 1
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of a host bitmask (new_bitmask)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. those of a discarded step)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"rollback: {num_tokens} tokens, but {self.num_accepted} were accepted")
        self._matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def reset(self) -> None:
        self._matcher.reset()
        self.num_accepted = 0


def fill_bitmask(matchers: Sequence[GrammarMatcher | None], vocab_size: int) -> torch.Tensor | None:
    """The host bitmask for one step's sampling rows, row i from matchers[i] (None: the row
    has no grammar and keeps every token); None when no row has a grammar."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = new_bitmask(len(matchers), vocab_size)
    for i in rows:
        matchers[i].fill(bitmask, i)
    return bitmask


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (escaped as vLLM does)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def literal(text: str) -> str:
        out = [escapes.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
               for ch in text]
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


class StructuredOutputCompiler:
    """Compiles specs against one tokenizer in a thread pool; results cached by spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], *,
                 max_workers: int = 2, cache_size: int = 256):
        """`vocab_size`: the model's (its logits' width, which may pad the tokenizer's);
        `stop_token_ids`: what a finished grammar allows (the model's end-of-sequence ids)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="rlserve-grammar")
        self._cache: OrderedDict[StructuredOutputsParams, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the cache
        self._compiler_lock = threading.Lock()  # held while the pool builds the compiler
        self._compiler = None  # built in the pool: reading the vocabulary takes a while

    def validate(self, spec: StructuredOutputsParams) -> None:
        """Parse the spec (no token masks yet: milliseconds), or raise InvalidRequestError
        naming the field and what xgrammar said."""
        import xgrammar as xgr
        kind = spec.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(spec.json, any_whitespace=not spec.disable_any_whitespace)
            elif kind == "regex":
                xgr.Grammar.from_regex(spec.regex)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(spec.grammar)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
            param = f"structured_outputs.{kind}"
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"{param}: cannot be compiled: {message}", param) from None

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A Future of the CompiledGrammar; requests with equal specs share one compile."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        return GrammarMatcher(grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        compiler = self._xgr_compiler()
        kind = spec.kind
        any_whitespace = not spec.disable_any_whitespace
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(spec.json, any_whitespace=any_whitespace)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(spec.choice))
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except Exception as e:
            param = f"structured_outputs.{kind}"
            raise InvalidRequestError(f"{param}: cannot be compiled: {e}", param) from None
        return CompiledGrammar(spec, compiled)

    def _xgr_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=8)
            return self._compiler

