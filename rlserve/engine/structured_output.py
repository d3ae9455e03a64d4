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

Bounds (GrammarLimits, the --max-grammar-size and --grammar-compile-timeout-s flags): a spec,
and the grammar xgrammar parses from it, larger than max_size bytes is refused by `validate`;
a compile first runs in a forked child, killed past timeout_s (xgrammar cannot be interrupted,
and some schemas of a few hundred kilobytes take hours), or as soon as no request waits for it
(`abandon`). Only a spec that compiled there in time is compiled again here, where its masks
are used.

xgrammar holds the C++ state; these types keep the engine's side small and typed.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import torch

from rlserve.config import GrammarLimits
from rlserve.process import die_with_parent
from rlserve.sampling_params import InvalidRequestError, StructuredOutputsParams

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import xgrammar
    from transformers import PreTrainedTokenizerBase

BITMASK_WORD_BITS = 32  # a packed int32 bitmask: bit j % 32 of word j // 32 allows token j


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // BITMASK_WORD_BITS)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, bitmask_width] int32 on the host, every token allowed (all bits set)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


class CompiledGrammar(NamedTuple):
    spec: StructuredOutputsParams
    compiled: xgrammar.CompiledGrammar


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
    rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = new_bitmask(len(matchers), vocab_size)
    for i, m in rows:
        m.fill(bitmask, i)
    return bitmask


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (escaped as vLLM does)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def literal(text: str) -> str:
        out = [escapes.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch) for ch in text]
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def _param(spec: StructuredOutputsParams) -> str:
    return f"structured_outputs.{spec.kind}"


def _source(spec: StructuredOutputsParams) -> str:
    """What xgrammar reads for a spec: its JSON schema, its regex, or its EBNF grammar (a
    choice's grammar; json_object's schema)."""
    kind = spec.kind
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "choice":
        assert spec.choice is not None  # its kind's field is set
        return choice_grammar(spec.choice)
    text = spec.json if kind == "json" else spec.regex if kind == "regex" else spec.grammar
    assert isinstance(text, str)  # set, and a schema is JSON text (StructuredOutputsParams makes it so)
    return text


def _parse(spec: StructuredOutputsParams) -> xgrammar.Grammar:
    """The xgrammar Grammar of a spec (a parse: milliseconds, no token masks)."""
    import xgrammar as xgr

    kind, text = spec.kind, _source(spec)
    if kind in ("json", "json_object"):
        return xgr.Grammar.from_json_schema(text, any_whitespace=not spec.disable_any_whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    return xgr.Grammar.from_ebnf(text)


def _compile_with(compiler: xgrammar.GrammarCompiler, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
    """The xgrammar CompiledGrammar of a spec (token masks: the slow part)."""
    kind, text = spec.kind, _source(spec)
    if kind in ("json", "json_object"):
        return compiler.compile_json_schema(text, any_whitespace=not spec.disable_any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def _trial_compile(tokenizer_info: xgrammar.TokenizerInfo, spec: StructuredOutputsParams, conn: Connection) -> None:
    """In a forked child: compile `spec`, send None or the error's text, exit."""
    die_with_parent()
    try:
        import xgrammar as xgr

        _compile_with(xgr.GrammarCompiler(tokenizer_info, max_threads=2), spec)
        conn.send(None)
    except Exception as e:  # the parent reports it as the request's error
        conn.send(str(e).strip() or type(e).__name__)
    finally:
        os._exit(0)  # no atexit handlers, no flushing of the parent's buffers


class StructuredOutputCompiler:
    """Compiles specs against one tokenizer in a thread pool; results cached by spec."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        limits: GrammarLimits = GrammarLimits(),
        max_workers: int = 2,
        cache_size: int = 256,
    ) -> None:
        """`vocab_size`: the model's (its logits' width, which may pad the tokenizer's);
        `stop_token_ids`: what a finished grammar allows (the model's end-of-sequence ids)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.limits = limits
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="rlserve-grammar")
        self._cache: OrderedDict[StructuredOutputsParams, Future[CompiledGrammar]] = OrderedDict()
        self._abandoned: dict[StructuredOutputsParams, threading.Event] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the cache
        self._compiler_lock = threading.Lock()  # held while the pool builds the compiler
        # Built in the pool: reading the vocabulary takes a while.
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._info: xgrammar.TokenizerInfo | None = None

    def validate(self, spec: StructuredOutputsParams) -> None:
        """Parse the spec (no token masks yet: milliseconds), or raise InvalidRequestError
        naming the field and what xgrammar said, or the size limit it passes."""
        param, limit = _param(spec), self.limits.max_size
        text = spec.json or spec.regex or spec.grammar or "".join(spec.choice or ())
        if len(text) > limit:
            raise InvalidRequestError(
                f"{param}: {len(text)} bytes, more than the limit of {limit} (--max-grammar-size)", param
            )
        try:
            size = len(str(_parse(spec)))
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"{param}: cannot be compiled: {message}", param) from None
        if size > limit:
            raise InvalidRequestError(
                f"{param}: its grammar is {size} bytes, more than the limit of {limit} (--max-grammar-size)", param
            )

    def compile(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """A Future of the CompiledGrammar; requests with equal specs share one compile."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            abandoned = self._abandoned[spec] = threading.Event()
            future = self._pool.submit(self._compile, spec, abandoned)
            self._cache[spec] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def abandon(self, spec: StructuredOutputsParams) -> None:
        """No request waits for `spec` any more: stop its compile if it is not done."""
        with self._lock:
            future = self._cache.get(spec)
            if future is None or future.done():
                return
            del self._cache[spec]
            self._abandoned.pop(spec).set()
            future.cancel()

    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        return GrammarMatcher(grammar)

    def shutdown(self) -> None:
        with self._lock:
            for event in self._abandoned.values():
                event.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputsParams, abandoned: threading.Event) -> CompiledGrammar:
        try:
            compiler = self._xgr_compiler()
            self._trial(spec, abandoned)
            return CompiledGrammar(spec, _compile_with(compiler, spec))
        except InvalidRequestError:
            raise
        except Exception as e:
            raise InvalidRequestError(f"{_param(spec)}: cannot be compiled: {e}", _param(spec)) from None
        finally:
            with self._lock:
                if self._abandoned.get(spec) is abandoned:
                    del self._abandoned[spec]

    def _trial(self, spec: StructuredOutputsParams, abandoned: threading.Event) -> None:
        """Compile `spec` in a forked child first: killed past the time limit, or when no
        request waits for it any more. Raises InvalidRequestError unless it compiled."""
        ctx = multiprocessing.get_context("fork")
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_trial_compile, args=(self._info, spec, send), daemon=True)
        child.start()
        send.close()
        deadline = time.monotonic() + self.limits.timeout_s
        try:
            while not receive.poll(0.05):
                if abandoned.is_set():
                    raise InvalidRequestError(f"{_param(spec)}: compile abandoned", _param(spec))
                if time.monotonic() > deadline:
                    raise InvalidRequestError(
                        f"{_param(spec)}: compiling it takes longer than the limit of "
                        f"{self.limits.timeout_s:g} s (--grammar-compile-timeout-s)",
                        _param(spec),
                    )
                if not child.is_alive() and not receive.poll():
                    raise InvalidRequestError(
                        f"{_param(spec)}: the compile failed (exit code {child.exitcode})", _param(spec)
                    )
            error = receive.recv()
        finally:
            if child.is_alive():
                child.kill()
            child.join()
            receive.close()
        if error is not None:
            raise InvalidRequestError(f"{_param(spec)}: cannot be compiled: {error}", _param(spec))

    def _xgr_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=8)
            return self._compiler
