"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of tokens and emitting only what grew, so a
multi-byte character split across tokens comes out whole. While stop strings are set,
the last (longest stop - 1) characters are held back, so a stream never shows the start
of a stop string that is then cut.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    stop: str
    text_end: int  # length of the text to keep


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        # A few prompt tokens as context: some tokenizers decode a leading space differently
        # at the start of a sequence.
        self.tokens = list(prompt_token_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all text decoded so far
        self.emitted = 0  # how much of self.text has been returned

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> StopMatch | None:
        """Append one token; returns the stop match if a stop string completed."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            before = len(self.text)
            self.text += delta
            if self.stop:
                return self._find_stop(before)
        return None

    def _find_stop(self, new_from: int) -> StopMatch | None:
        best: StopMatch | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or i < best.text_end):
                best = StopMatch(s, i)
        if best is not None:
            end = best.text_end + (len(best.stop) if self.include_stop else 0)
            self.text = self.text[:end]
            best.text_end = end
        return best

    def take(self, final: bool) -> str:
        """Text not yet returned; holds back a possible stop-string start unless final."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
