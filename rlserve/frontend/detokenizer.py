"""Incremental detokenization with stop strings, on the front end.

A sample's text grows as its tokens arrive. Fast tokenizers decode through the tokenizers
library's DecodeStream (a few microseconds a token, a multi-byte character split across
tokens comes out whole); others decode a short window of tokens and keep what grew. The
stream starts from the last prompt tokens, so a leading space decodes as it would inside
the sequence.

Stop strings are looked for only in text that tokens after the first `min_tokens` produced
(as vLLM does); a match cuts the text (and the rest of its token's text) at the stop
string, which is kept with include_stop_str_in_output. While stop strings are set, the last
(longest stop - 1) characters are held back, so a stream never shows the start of a stop
string that is then cut.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTEXT_TOKENS = 6  # prompt tokens the decoding starts from


@dataclass
class StopMatch:
    stop: str
    text_end: int  # length of the text to keep


def _decode_stream_class():
    try:
        from tokenizers.decoders import DecodeStream
        DecodeStream(ids=[], skip_special_tokens=True)  # the prefill argument is recent
        return DecodeStream
    except (ImportError, TypeError):
        return None


_DecodeStream = _decode_stream_class()


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.min_tokens = min_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all text decoded so far
        self.emitted = 0  # how much of self.text has been returned
        self.num_tokens = 0
        self.check_from = 0  # stop strings are looked for from here on
        self.pending: list[int] = []  # tokens whose text is not out yet (a split character)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and _DecodeStream is not None:
            self._backend = backend
            self._stream = _DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        else:  # a slow tokenizer: decode a window
            self._stream = None
            self.tokens = context
            self.prefix_offset = 0
            self.read_offset = len(context)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special,
                                     clean_up_tokenization_spaces=False)

    def _step(self, token_id: int) -> str | None:
        if self._stream is not None:
            return self._stream.step(self._backend, token_id)
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix):]
        return None

    def add(self, token_id: int) -> StopMatch | None:
        """Append one token; returns the stop match if a stop string completed."""
        self.num_tokens += 1
        delta = self._step(token_id)
        if delta is None:
            self.pending.append(token_id)
            return None
        self.pending.clear()
        self.text += delta
        if not self.stop:
            return None
        if self.num_tokens <= self.min_tokens:  # too early to stop: not looked at again
            self.check_from = len(self.text)
            return None
        return self._find_stop()

    def _find_stop(self) -> StopMatch | None:
        best: StopMatch | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, self.check_from - len(s) + 1))
            if i >= 0 and (best is None or i < best.text_end):
                best = StopMatch(s, i)
        self.check_from = len(self.text)
        if best is not None:
            end = best.text_end + (len(best.stop) if self.include_stop else 0)
            self.text = self.text[:end]
            best.text_end = end
        return best

    def finish(self) -> None:
        """The sample ended: text of tokens still waiting for the rest of a character
        is decoded as it stands (replacement characters), so the text covers every token."""
        if self.pending:
            self.text += self._decode(self.pending)
            self.pending.clear()

    def take(self, final: bool) -> str:
        """Text not yet returned; holds back a possible stop-string start unless final."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
