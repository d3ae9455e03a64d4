"""`bad_words` (strings) as the token-id sequences the engine masks, with vLLM's semantics.

A word is banned at the start of the text and in the middle of it, so each is tokenized
without and with a leading space. The spaced form is kept only when it is a different
word token of the same length (as vLLM does): the sampler masks a sequence's last token
once the output ends with the rest of it.
"""

from __future__ import annotations

import dataclasses

from rlserve.sampling_params import InvalidRequestError, SamplingParams


def bad_words_to_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    sequences: list[list[int]] = []
    for word in words:
        for leading_space in (False, True):
            text = (" " if leading_space else "") + word.lstrip()
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if not ids:
                if not leading_space:
                    raise InvalidRequestError(f"bad_words: {word!r} is no token at all", "bad_words")
                continue
            if not leading_space or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                sequences.append(ids)
    return sequences


def convert_bad_words(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with its `bad_words` moved into `bad_words_token_ids` (unchanged if none)."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise InvalidRequestError("bad_words: needs a tokenizer (the engine runs without one); "
                                  "pass bad_words_token_ids instead", "bad_words")
    ids = (params.bad_words_token_ids or []) + bad_words_to_token_ids(tokenizer, params.bad_words)
    return dataclasses.replace(params, bad_words=None, bad_words_token_ids=ids)
