"""Errors of the weight-transfer layer, defined in rlserve/errors.py (every error that
crosses a process is) and known here by the names trainers import.

Two families, kept apart on purpose so a handler can map them without caring
about `except` order:

- `InvalidUpdateError` (a ValueError): the trainer's request is wrong (bad
  init_info / update_info, names or shapes the model does not have). HTTP 400;
  the group stays usable and the old weights keep serving.
- `WeightTransferError` (a RuntimeError): the transport failed (timeout, peer
  gone, group unusable). The group must be initialised again.
- `UpdateRefusedError` (a WeightTransferError), trainer side: the server refused the
  update before any byte moved; the group stays usable.
"""

from rlserve.errors import InvalidUpdateError, UpdateRefusedError, WeightTransferError

__all__ = ["InvalidUpdateError", "UpdateRefusedError", "WeightTransferError"]
