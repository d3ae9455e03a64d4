"""The front end's side of a step: engine outputs -> per-request state, text, stop strings.

The engine core reports token ids (outputs.py); here they become each sample's tokens,
logprobs, weight versions and text. A stop string is found here, so the sample ends here
and the engine is asked to abort it (it may have computed a token or two more, which are
dropped). The offline LLM and the API server's AsyncEngine both use this, the one in
process, the other on every message from the engine-core process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from rlserve.frontend.detokenizer import IncrementalDetokenizer
from rlserve.frontend.request_output import CompletionOutput, RequestOutput
from rlserve.sampling_params import SamplingParams
from rlserve.sequence import TokenLogprob
from rlserve.wire.outputs import EngineCoreOutputs, FinalTokens, Finished, RequestTiming, Started
from rlserve.wire.validation import sample_ids


class LatencyObserver(Protocol):
    """Where a sample's timings go (the server's Prometheus histograms). Latencies from
    arrival are the front end's; the gaps between tokens and a request's phases in the engine
    are the engine's (stamped when a step's tokens are read back, whether or not anyone
    streams them)."""

    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float, count: int) -> None: ...
    def finished(self, reason: str, seconds: float) -> None: ...
    def request_phases(self, timing: RequestTiming, num_tokens: int) -> None: ...


class SampleDelta:
    """What is new in one sample since the consumer last looked."""

    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason", "first")

    def __init__(self, index: int, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None,
                 finish_reason: str | None, stop_reason: int | str | None, first: bool):
        self.index, self.text, self.token_ids, self.logprobs = index, text, token_ids, logprobs
        self.finish_reason, self.stop_reason, self.first = finish_reason, stop_reason, first


class SampleState:
    """One sample of a request: its tokens and text so far."""

    __slots__ = ("request", "index", "request_id", "token_ids", "logprobs", "token_versions",
                 "detok", "finish_reason", "stop_reason", "last_time", "sent_tokens", "started",
                 "sent_all", "routed_experts")

    def __init__(self, request: RequestState, index: int, request_id: str):
        self.request = request
        self.index = index
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if request.params.logprobs is not None else None
        self.token_versions: list[int] = []
        self.detok: IncrementalDetokenizer | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.last_time = 0.0  # the engine's stamp of its latest streamed token (0: none yet)
        self.sent_tokens = 0  # tokens the consumer has seen
        self.started = False  # the consumer has seen something of it
        self.sent_all = False  # the consumer has seen its end
        self.routed_experts: np.ndarray | None = None  # with its end, when the engine records routes

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    """One prompt and its n samples, as the front end assembles them.

    `notify` is called after each engine message that changed the request when `stream`
    is set, else once, when every sample has finished (or on an error).
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival: float | None = None,
                 notify: Callable[[], None] | None = None, stream: bool = False):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival = time.monotonic() if arrival is None else arrival
        self.notify = notify
        self.stream = stream
        self.samples = [SampleState(self, i, rid) for i, rid in enumerate(sample_ids(request_id, params.n))]
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.num_cached_tokens = 0
        self.weight_version = 0
        self.weight_labels: Mapping[int, str] = {}  # version -> label, the engine's (shared, kept current)
        self.num_finished = 0
        self.error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples) or self.error is not None

    def deltas(self) -> list[SampleDelta]:
        """What each sample gained since the last call (text held back near a possible stop
        string is not out yet); samples with nothing new are left out."""
        out = []
        for s in self.samples:
            if s.sent_all or (s.started and not s.finished and s.sent_tokens == len(s.token_ids)):
                continue
            new = s.token_ids[s.sent_tokens:]
            lps = s.logprobs[s.sent_tokens:] if s.logprobs is not None else None
            text = s.detok.take(final=s.finished) if s.detok is not None else ""
            first = not s.started
            s.sent_tokens = len(s.token_ids)
            s.started = True
            s.sent_all = s.finished
            out.append(SampleDelta(s.index, text, new, lps, s.finish_reason, s.stop_reason, first))
        return out

    def output(self) -> RequestOutput:
        """Everything so far as the offline API's RequestOutput (lists are not copied)."""
        outs = [CompletionOutput(s.index, s.text, s.token_ids, s.logprobs, s.finish_reason,
                                 s.stop_reason, s.token_versions, s.routed_experts) for s in self.samples]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             self.prompt_logprobs, outs, self.finished, self.weight_version,
                             self.num_cached_tokens)


class OutputProcessor:
    def __init__(self, tokenizer, observer: LatencyObserver | None = None):
        self.tokenizer = tokenizer
        self.observer = observer
        self.samples: dict[str, SampleState] = {}  # engine id of every unfinished sample
        # Samples a stop string ended here: their phases in the engine come with the engine's
        # Finished for them (the abort, or their own end if it came first)
        self.ending: dict[str, SampleState] = {}
        # Samples a stop string ended here that wait for their routes, which come with the
        # engine's Finished for them: (sample, the stop string)
        self.awaiting_routes: dict[str, tuple[SampleState, str]] = {}
        self.routes_expected = False  # the engine records routes (set by its owner)

    def add(self, state: RequestState) -> None:
        p = state.params
        detokenize = p.detokenize and self.tokenizer is not None
        for s in state.samples:
            if detokenize:
                s.detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, p.stop or [],
                                                 p.include_stop_str_in_output, p.skip_special_tokens,
                                                 p.min_tokens)
            self.samples[s.request_id] = s

    @staticmethod
    def needs_steps(params: SamplingParams) -> bool:
        """Whether the engine must report this request's tokens every step even when nobody
        streams them: stop strings are matched here, as the text grows."""
        return bool(params.stop) and params.detokenize

    def process(self, out: EngineCoreOutputs) -> list[str]:
        """Take one step's outputs; returns the engine ids of samples a stop string ended,
        which the engine must abort."""
        now = time.monotonic()
        stamp = out.timestamp
        samples = self.samples
        version = out.version
        touched: dict[int, RequestState] = {}
        aborts: list[str] = []
        for st in out.started:
            self._started(st)
        logprobs = out.logprobs
        for i, (rid, token) in enumerate(zip(out.request_ids, out.token_ids)):
            s = samples.get(rid)
            if s is None:  # ended here already (a stop string): the engine catches up
                continue
            s.token_ids.append(token)
            s.token_versions.append(version)
            if logprobs is not None and s.logprobs is not None:
                s.logprobs.append(logprobs[i])  # type: ignore[arg-type]  # not None: this sample asked
            self._token_time(s, stamp, now)
            req = s.request
            req.weight_version = version
            touched[id(req)] = req
            if s.detok is not None:
                match = s.detok.add(token)
                if match is not None:
                    self._stop_string(s, match.stop, now)
                    aborts.append(rid)
        for f in out.finished:
            s = samples.get(f.request_id)
            if s is None and f.request_id in self.awaiting_routes:
                s, stop = self.awaiting_routes.pop(f.request_id)
                self._take_routes(s, f)
                touched[id(s.request)] = s.request
                self._finish(s, "stop", stop, now, f.timing)
                continue
            if s is None:
                s = self.ending.pop(f.request_id, None)
                if s is not None and f.timing is not None:
                    assert self.observer is not None  # only samples it observes wait in `ending`
                    self.observer.request_phases(f.timing, len(s.token_ids))
                continue
            if f.final is not None:
                self._absorb(s, f.final, now, f.timing)
            self._take_routes(s, f)
            req = s.request
            req.weight_version = max(req.weight_version, version)
            touched[id(req)] = req
            if s.detok is not None:
                s.detok.finish()
            self._finish(s, f.reason, f.stop_reason, now, f.timing)
        for req in touched.values():
            if req.notify is not None and (req.stream or req.finished):
                req.notify()
        return aborts

    def _started(self, st: Started) -> None:
        s = self.samples.get(st.request_id)
        if s is not None:
            req = s.request
            req.num_cached_tokens = max(req.num_cached_tokens, st.num_cached_tokens)
            if st.prompt_logprobs is not None and req.prompt_logprobs is None:
                req.prompt_logprobs = st.prompt_logprobs

    def _absorb(self, s: SampleState, final: FinalTokens, now: float, timing: RequestTiming | None) -> None:
        """A non-streamed sample's tokens, all at once, timed by the engine."""
        s.token_ids.extend(final.token_ids)
        if s.logprobs is not None and final.logprobs is not None:
            s.logprobs.extend(final.logprobs)
        for version, start, end in final.version_spans:
            s.token_versions.extend([version] * (end - start))
        req = s.request
        req.num_cached_tokens = max(req.num_cached_tokens, final.num_cached_tokens)
        if final.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = final.prompt_logprobs
        if final.version_spans:
            req.weight_version = max(req.weight_version, final.version_spans[-1][0])
        if s.detok is not None:
            for token in final.token_ids:
                s.detok.add(token)
        if self.observer is not None and timing is not None and timing.since_first_token >= 0:
            # The first token came since_first_token before the engine sent this; the gaps
            # between the others are known by their mean (the engine keeps no time per token).
            self.observer.first_token(max(now - req.arrival - timing.since_first_token, 0.0))
            n = len(final.token_ids)
            if n > 1:
                self.observer.inter_token(timing.decode / (n - 1), n - 1)

    def _stop_string(self, s: SampleState, stop: str, now: float) -> None:
        """A stop string ended `s` here; with routes recorded it ends once the engine's
        Finished for it (the abort) brings them."""
        if self.routes_expected and s.request.params.return_routed_experts is not False:
            self.samples.pop(s.request_id)
            self.awaiting_routes[s.request_id] = (s, stop)
        else:
            self._finish(s, "stop", stop, now)

    @staticmethod
    def _take_routes(s: SampleState, f: Finished) -> None:
        """A finished sample's routes: a row for each of its tokens that went through the
        model (the engine may have run a token or two past a stop string: cut off)."""
        if f.routed_experts is not None:
            s.routed_experts = f.routed_experts.array()[:len(s.request.prompt_token_ids) + len(s.token_ids) - 1]

    def _token_time(self, s: SampleState, stamp: float, now: float) -> None:
        """A streamed token: TTFT on arrival here, a gap between the engine's stamps after."""
        if self.observer is None:
            return
        if s.last_time:
            self.observer.inter_token(stamp - s.last_time, 1)
        else:
            self.observer.first_token(now - s.request.arrival)
        s.last_time = stamp

    def _finish(self, s: SampleState, reason: str, stop_reason, now: float,
                timing: RequestTiming | None = None) -> None:
        s.finish_reason, s.stop_reason = reason, stop_reason
        self.samples.pop(s.request_id, None)
        req = s.request
        req.num_finished += 1
        if self.observer is not None:
            self.observer.finished(reason, now - req.arrival)
            if timing is not None:
                self.observer.request_phases(timing, len(s.token_ids))
            else:  # ended here: the engine's Finished (for the abort) brings its phases
                self.ending[s.request_id] = s

    def fail(self, state: RequestState, error: BaseException) -> None:
        """End a request with an error (the engine refused it, or died)."""
        state.error = error
        for s in state.samples:
            self.samples.pop(s.request_id, None)
            self.ending.pop(s.request_id, None)
            self.awaiting_routes.pop(s.request_id, None)
        if state.notify is not None:
            state.notify()

    def fail_all(self, error: BaseException) -> None:
        for state in {id(s.request): s.request for s in self.samples.values()}.values():
            self.fail(state, error)

    def remove(self, state: RequestState) -> list[str]:
        """Forget a request (its consumer left); returns the engine ids still running."""
        running = [s.request_id for s in state.samples if self.samples.pop(s.request_id, None)]
        for s in state.samples:
            self.awaiting_routes.pop(s.request_id, None)
        return running
