"""How to sample, as a user asks for it: SamplingParams (vLLM's fields and meanings) and
the structured-output spec, checked when they are made.

Its own module, as vLLM's sampling_params.py, below the engine and the workers: the API
server builds these values, the engine core runs requests with them, and a worker
process of another tensor-parallel rank rebuilds them from a step message
(rlserve.worker.channel). InvalidRequestError, the user error their checks raise, lives
here for the same reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from rlserve import json_depth
from rlserve.errors import InvalidRequestError  # noqa: F401 (re-exported: the name callers know)

MAX_LOGPROBS = 20  # --max-logprobs by default (vLLM's)
MAX_LOGIT_BIAS = 100.0  # OpenAI's and vLLM's range for a bias: [-100, 100]




_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `structured_outputs`: the output must match exactly one of a JSON schema
    (`json`), any JSON object (`json_object`), a regular expression, one of `choice`, or an
    EBNF `grammar` (rlserve.engine.structured_output compiles them). Frozen and hashable:
    compiled grammars are cached by it. The front end maps OpenAI's `response_format` and
    vLLM's older `guided_*` fields onto it."""

    json: str | dict | None = None  # a JSON schema, as JSON text or a dict
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self) -> None:
        def bad(field_: str, message: str) -> NoReturn:
            param = f"structured_outputs.{field_}" if field_ else "structured_outputs"
            raise InvalidRequestError(f"{param}: {message}", param)

        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            bad("", f"set exactly one of {', '.join(_STRUCTURED_KINDS)}, got "
                    f"{', '.join(kinds) if kinds else 'none'}")
        if isinstance(self.json, dict):  # canonical text: equal schemas share a compiled grammar
            object.__setattr__(self, "json", json.dumps(self.json, separators=(",", ":"), ensure_ascii=False))
        if self.json is not None:
            if not isinstance(self.json, str):
                bad("json", f"must be a JSON schema (an object), got {type(self.json).__name__}")
            try:
                schema = json_depth.loads(self.json)
            except json_depth.JSONTooDeepError as e:
                bad("json", str(e))
            except ValueError as e:
                bad("json", f"is not valid JSON: {e}")
            if not isinstance(schema, dict):
                bad("json", f"must be a JSON schema (an object), got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(name, "must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice):
                bad("choice", "must be a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                bad("choice", "must hold at least one string")
        if self.json_object not in (None, True, False):
            bad("json_object", f"must be true, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

# raw: log_softmax of the model's logits (what RL importance ratios need); processed: of the
# logits sampled from, after bias, masks, penalties, temperature, min-p, top-k and top-p.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class SamplingParams:
    """How to sample. Field names and meanings follow vLLM's SamplingParams.

    Logprobs are those of the model's raw distribution (log_softmax of the logits, before
    any processing), which is what RL importance ratios need, unless the engine runs with
    logprobs_mode="processed_logprobs" (EngineConfig).

    The logits go through, in vLLM's order: the `structured_outputs` grammar's mask,
    `allowed_token_ids` (every other token masked), bans (`bad_words_token_ids`, and the
    stop tokens while below `min_tokens`), `logit_bias`, the penalties, then temperature,
    min-p, top-k and top-p.
    `bad_words` are strings the front end turns into `bad_words_token_ids`
    (rlserve.frontend.bad_words); the engine itself only reads token ids.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # None: none; k >= 0: the sampled (or prompt) token plus the k most likely alternatives;
    # -1: every token of the vocabulary (allowed up to the engine's max_logprobs)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The alternatives are these tokens at every position, in this order, instead of the
    # most likely ones (vLLM's logprob_token_ids: a verifier's or reward's tokens).
    logprob_token_ids: list[int] | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    # Penalties: repetition over prompt and output tokens (1 = off; a positive logit is
    # divided by it, a negative one multiplied); presence and frequency over output tokens
    # only (logit -= presence * (count > 0) + frequency * count).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # None: all; else every other token is masked
    bad_words: list[str] | None = None  # converted by the front end, see the class docstring
    # The last token of each sequence is masked when the output so far ends with the rest.
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Routing replay (SGLang's request field): None follows the engine's
    # enable_return_routed_experts; False skips this request's routes; True requires them
    return_routed_experts: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None:
            self.top_k = -1
        if self.logit_bias is not None:
            self.logit_bias = _token_keys(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(seq) for seq in self.bad_words_token_ids]
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(self.logprob_token_ids)
            if self.logprobs is None:
                self.logprobs = 0  # the sampled token's, and the chosen ones
        if isinstance(self.structured_outputs, dict):  # from a step message (dataclasses.asdict)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        def bad(param: str, message: str) -> NoReturn:
            raise InvalidRequestError(f"{param}: {message}", param)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1 (disabled) or at least 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                bad(name, f"must be -1 (the whole vocabulary) or at least 0, got {value}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            bad("seed", f"must be in [{-(2**63)}, {2**63 - 1}] (a signed 64-bit integer), got {self.seed}")
        if any(not s for s in self.stop or ()):  # a list once __post_init__ ran
            bad("stop", "stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # NaN fails too
                bad(name, f"must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad("repetition_penalty", f"must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                bad("logit_bias", f"token id {token} is negative")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                bad("logit_bias", f"the bias of token {token} must be in "
                                  f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty (leave it unset to allow every token)")
            _check_ids("allowed_token_ids", self.allowed_token_ids)
        if self.logprob_token_ids is not None:
            if not self.logprob_token_ids:
                bad("logprob_token_ids", "must not be empty (leave it unset for the top logprobs)")
            _check_ids("logprob_token_ids", self.logprob_token_ids)
        if any(not isinstance(w, str) or not w for w in self.bad_words or ()):
            bad("bad_words", "must be non-empty strings")
        for seq in self.bad_words_token_ids or ():
            if not seq:
                bad("bad_words_token_ids", "each sequence must hold at least one token id")
            _check_ids("bad_words_token_ids", seq)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            bad("structured_outputs", f"must be a StructuredOutputsParams, got "
                                      f"{type(self.structured_outputs).__name__}")

    def validate_token_ids(self, vocab_size: int) -> None:
        """The checks that need the model: every token id these parameters name is in the
        vocabulary, and `bad_words` were turned into token ids (the front end's job)."""
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("logprob_token_ids", self.logprob_token_ids or ()),
                          ("bad_words_token_ids", [t for seq in self.bad_words_token_ids or () for t in seq])):
            out = sorted({t for t in ids if t >= vocab_size})
            if out:  # all of them named: one round trip fixes the request
                raise InvalidRequestError(
                    f"{name}: token id{'s' if len(out) > 1 else ''} {', '.join(map(str, out[:20]))}"
                    f"{' ...' if len(out) > 20 else ''} {'are' if len(out) > 1 else 'is'} out of "
                    f"vocabulary (ids 0 to {vocab_size - 1})", name)
        if self.bad_words:
            raise InvalidRequestError(
                "bad_words: must be converted to bad_words_token_ids before the engine "
                "(rlserve.frontend.bad_words.convert_bad_words)", "bad_words")

    @property
    def uses_logits_processors(self) -> bool:
        """Anything beyond temperature, top-k/p, min-p and min_tokens."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids
                    or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_logprobs_limit(name: str, value: int | None, max_logprobs: int, vocab_size: int,
                         param: str | None = None) -> None:
    """A request's count of logprobs (-1: the whole vocabulary) against the engine's
    max_logprobs (--max-logprobs; -1: the whole vocabulary), as vLLM counts them. `param`:
    the field the error names, where it is not `name`."""
    if value is None:
        return
    asked = vocab_size if value == -1 else value
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    if asked > limit:
        what = f"-1 (the whole vocabulary, {vocab_size} tokens)" if value == -1 else str(value)
        allowed = f"-1, the whole vocabulary of {vocab_size} tokens" if max_logprobs == -1 else str(limit)
        raise InvalidRequestError(f"{name}: {what} is more than --max-logprobs ({allowed})", param or name)


def _token_keys(bias: dict) -> dict[int, float]:
    """logit_bias with int keys: JSON (OpenAI's API) and msgpack carry them as strings.
    Every key that is not a token id is named at once."""
    out: dict[int, float] = {}
    bad_keys = []
    for key, value in dict(bias).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            bad_keys.append(key)
            continue
        if isinstance(key, float) and key != token:
            bad_keys.append(key)
            continue
        try:
            out[token] = float(value)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias: the bias of token {token} is not a number: {value!r}",
                                      "logit_bias") from None
    if bad_keys:
        shown = ", ".join(repr(k) for k in bad_keys[:20]) + (" ..." if len(bad_keys) > 20 else "")
        what = "are not token ids" if len(bad_keys) > 1 else "is not a token id"
        raise InvalidRequestError(f"logit_bias: key{'s' if len(bad_keys) > 1 else ''} {shown} {what} "
                                  "(token ids are integers, written as strings in JSON)", "logit_bias")
    return out


def _check_ids(param: str, ids) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise InvalidRequestError(f"{param}: {t!r} is not a token id (an integer >= 0)", param)
