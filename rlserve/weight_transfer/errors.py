"""Errors of the weight-transfer layer.

Two families, kept apart on purpose so a handler can map them without caring
about `except` order:

- `InvalidUpdateError` (a ValueError): the trainer's request is wrong (bad
  init_info / update_info, names or shapes the model does not have). HTTP 400;
  the group stays usable and the old weights keep serving.
- `WeightTransferError` (a RuntimeError): the transport failed (timeout, peer
  gone, group unusable). The group must be initialised again.
"""


class InvalidUpdateError(ValueError):
    """A trainer-supplied init_info/update_info is invalid; the message names the fields."""


class WeightTransferError(RuntimeError):
    """The transfer itself failed or timed out; the group is unusable until re-init."""


class UpdateRefusedError(WeightTransferError):
    """Trainer side: the server refused the update before any byte moved.

    The message is exactly the one the server returned in its HTTP 400, and the
    group stays usable for the next (corrected) update.
    """
