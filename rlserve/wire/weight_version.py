"""The one parser of weight versions, for every route and field that carries one
(/finish_weight_update's weight_version, /update_weight_version's new_version,
update_info.weight_version).

vLLM takes any string as a version, and trainers label versions by step ("step-100").
rlserve numbers the weights it serves (every token reports the number that made it), so
a version is either a number (an integer, or a string of ASCII digits: it becomes the
served number) or a label (any other printable string: the next number is served under
that label). A number must fit 63 bits, since it travels as a signed 64-bit integer with
every step's tokens; a label is bounded in length. Anything else is the caller's error,
named by field, never a 500.
"""

from __future__ import annotations

from typing import Any

from rlserve.sampling_params import InvalidRequestError

MAX_VERSION = (1 << 63) - 1
MAX_LABEL_CHARS = 256
_ASCII_DIGITS = frozenset("0123456789")

WeightVersion = int | str  # a number, or a label


def parse_version(value: Any, field: str = "weight_version") -> WeightVersion | None:
    """`value` as a number (int) or a label (str); None stays None. Raises
    InvalidRequestError naming `field` for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidRequestError(f"{field}: a weight version is an integer or a string, got "
                                  f"{type(value).__name__}", field)
    if isinstance(value, str):
        if len(value) > MAX_LABEL_CHARS:
            raise InvalidRequestError(f"{field}: a weight version is at most {MAX_LABEL_CHARS} characters, "
                                      f"got {len(value)}", field)
        if not value or not value.isprintable():
            raise InvalidRequestError(f"{field}: a weight version label must be a non-empty printable "
                                      f"string, got {value!r:.80}", field)
        # str.isdigit() also accepts '²' and '①', which int() refuses: ASCII digits only.
        if not _ASCII_DIGITS.issuperset(value):
            return value
        if len(value) > 19:  # a number of 20 digits or more cannot fit; int() of it is not needed
            raise _out_of_range(value, field)
        value = int(value)
    if not 0 <= value <= MAX_VERSION:
        raise _out_of_range(value, field)
    return value


def _out_of_range(value: int | str, field: str) -> InvalidRequestError:
    # str() of a huge integer is slow, or refused past 4300 digits: describe it instead.
    shown = value if isinstance(value, str) else (str(value) if abs(value) < 1 << 128
                                                  else f"an integer of {value.bit_length()} bits")
    return InvalidRequestError(f"{field}: a numeric weight version must be in 0..{MAX_VERSION} (it travels "
                               f"as a 64-bit integer with every token), got {shown:.60}", field)
