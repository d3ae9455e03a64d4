"""The checks a request passes on both sides of the wire: the front end runs them before
sending (a clear 400 at once), the engine-core process again on arrival (it may be reached
by another front end). Also the ids a prompt's n samples take, which both sides compute."""

from __future__ import annotations

from rlserve.sampling_params import InvalidRequestError, SamplingParams, check_logprobs_limit


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine's id of each of a prompt's n samples."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def validate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                    vocab_size: int, max_logprobs: int) -> None:
    """What a prompt must satisfy to run; the front end checks before sending, the engine again.
    `max_logprobs`: the most logprobs a request may ask for (-1: the whole vocabulary)."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt: must contain at least one token", "prompt")
    # vLLM names `input_tokens` when the prompt leaves no room for the tokens asked for.
    if n >= max_model_len:
        raise InvalidRequestError(
            f"input_tokens: the prompt has {n} tokens, but max_model_len is {max_model_len} (the "
            "prompt and at least one generated token must fit)", "input_tokens")
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"input_tokens: the prompt has {n} tokens and max_tokens asks for {params.max_tokens} "
            f"more, but max_model_len is {max_model_len}; shorten the prompt or lower max_tokens",
            "input_tokens")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:  # C speed; then find it
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(
            f"prompt: token id {bad} is out of vocabulary (ids 0 to {vocab_size - 1})", "prompt")
    for t in params.stop_token_ids or ():
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"stop_token_ids: token id {t} is out of vocabulary (ids 0 to {vocab_size - 1})",
                "stop_token_ids")
    # An id out of range would index outside the logits on the device.
    params.validate_token_ids(vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        check_logprobs_limit(name, getattr(params, name), max_logprobs, vocab_size)


def check_cache_salt(salt: object) -> None:
    """A salt is absent (None) or a non-empty string: an empty one would look set but isolate nothing."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError(f"cache_salt: must be a non-empty string when given, got {salt!r}",
                                  "cache_salt")
