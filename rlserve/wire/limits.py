"""64-bit bounds on the integers of a JSON value: what the control plane checks before an
integer reaches a typed message or a C type (both sides: the API server's routes and the
front end's update path)."""

from __future__ import annotations

from typing import Any

import msgspec

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def out_of_range_int(value: Any, where: str) -> str | None:
    """The path of the first integer in `value` (nested lists and objects) that does not
    fit 64 bits, or None. The engine's messages carry 64-bit integers: a larger one would
    fail there as an OverflowError, not as the caller's error. Walked without recursion."""
    stack = [(where, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if not INT64_MIN <= item <= INT64_MAX:
                return path
        elif isinstance(item, dict):
            stack.extend((f"{path}.{k}", v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
    return None


_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_NINETEEN_DIGITS = b"0" * 19  # every integer below 10**18 fits 64 bits


def check_int_range(value: Any, where: str) -> None:
    """Raise InvalidRequestError naming the first integer in `value` beyond 64 bits.

    An IPC update of a per-expert MoE checkpoint is some 200,000 values, and a walk over
    them in Python took 300 ms, ten times the copy it announces. Only an integer of 19
    digits or more can be out of range, so the value is first encoded and searched for a
    run of 19 digits (both in C, a few ms); only a body with one (a string's digits count
    too) is walked, which names the offender or finds none."""
    from rlserve.sampling_params import InvalidRequestError
    if _NINETEEN_DIGITS not in msgspec.json.encode(value).translate(_DIGITS_TO_ZERO):
        return
    path = out_of_range_int(value, where)
    if path is not None:
        raise InvalidRequestError(f"{path}: must fit in 64 bits ({INT64_MIN}..{INT64_MAX})",
                                  where.split(".")[0])
