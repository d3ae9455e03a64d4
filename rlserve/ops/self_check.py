"""Start-up checks of fast kernels on the card they run on.

Each fast path that tests cannot pin down for every card (a Triton compiler's rounding, its
random-number primitives) is run once at start on a known case against the arithmetic it
replaces. One that fails, by raising or by answering differently, is named in a warning and
replaced by what it replaces: it is never served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def passes(kernel: str, check: Callable[[], str | None], instead: str) -> bool:
    """Run `check` (None when the kernel agrees, else what differs); on a failure warn,
    naming `kernel` and what runs `instead`."""
    try:
        reason = check()
    except Exception as e:  # an old or broken Triton
        reason = f"{type(e).__name__}: {e}"
    if reason is None:
        return True
    logger.warning("kernel %s failed its self-check on this card (%s); %s", kernel, reason, instead)
    return False
