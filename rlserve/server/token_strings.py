"""Single tokens as the logprobs of a response show them: text, and exact bytes."""

from __future__ import annotations

import math
import re
from typing import Any

# Logprobs travel as JSON, which has no -inf; OpenAI-compatible servers use this floor.
LOGPROB_FLOOR = -9999.0

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def floor_logprob(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte -> printable-character table of byte-level BPE (GPT-2)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenStrings:
    """Text and exact bytes of single tokens, for logprobs. A token that is half of a UTF-8
    character decodes to U+FFFD, but its bytes are still its own. `as_ids` (the
    return_tokens_as_token_ids extension, and requests that skip detokenization) writes
    'token_id:<id>' instead, which never collides and needs no decoding."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = _byte_decoder() if "ByteLevel" in repr(decoder) else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            hit = self._cache[token_id] = (text, self._bytes(token_id, text))
        return hit

    def text(self, token_id: int, as_id: bool = False) -> str:
        return f"token_id:{token_id}" if as_id else self.get(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self.get(token_id)[1]

    def _bytes(self, token_id: int, text: str) -> list[int]:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level is not None and all(ch in self._byte_level for ch in piece):
                return [self._byte_level[ch] for ch in piece]
            m = _BYTE_PIECE.match(piece)
            if m:  # SentencePiece byte fallback
                return [int(m.group(1), 16)]
        return list(text.encode("utf-8"))
