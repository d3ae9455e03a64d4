"""Bucket checksums: exact integer arithmetic where the bytes are, no host round trip.

A bucket's bytes are read as little-endian int64 words laid out in rows of ROW_WORDS;
each row is summed (mod 2^64), and the row sums are combined with odd weights 1, 3, 5, ...
The unfinished last row and the last (n mod 8) bytes, zero-padded to a word, count as
two more rows. Integer addition mod 2^64 does not depend on the order of the reduction,
so CPU and GPU, trainer and server, get the same value bit for bit. Any change to a single
word changes the result (odd weights are invertible mod 2^64), and a bucket that is
short, shifted or holds another bucket's bytes differs with overwhelming probability.
It guards against transport and protocol faults, not a malicious trainer (which can
send any weights it likes anyway).

One pass over memory: cheap next to moving the bytes. On CUDA it runs on a side stream,
overlapping the transfer; on the host it runs in numpy, on the calling thread (torch's
intra-op threads would contend with the engine's, and numpy releases the GIL).
"""

from __future__ import annotations

import numpy as np
import torch

ROW_WORDS = 4096  # 32 KiB rows: row sums are few, the weighting pass is negligible
# Per device, every weight vector made so far: one may still be read by queued work on
# some stream, so none is ever freed (they double in size; a 16 GB bucket needs 4 MB).
_weights: dict[torch.device, list[torch.Tensor]] = {}


def _row_weights(rows: int, device: torch.device) -> torch.Tensor:
    """1, 3, 5, ... (rows of them), made once per device and size class."""
    made = _weights.setdefault(device, [])
    if not made or made[-1].numel() < rows:
        size = max(rows, 2 * made[-1].numel() if made else 1024)
        made.append(torch.arange(1, 2 * size, 2, dtype=torch.int64, device=device))
    return made[-1][:rows]


def checksum_into(buf: torch.Tensor, out: torch.Tensor) -> None:
    """Write the checksum of `buf` (a 1-D uint8 tensor) into `out` (one int64 element on
    buf's device); on CUDA asynchronously, on the current stream."""
    if buf.device.type == "cpu":
        out.fill_(host_checksum(buf.contiguous().numpy()))
        return
    device_checksum_into(buf, out)


def host_checksum(data: np.ndarray) -> int:
    """The same function as `device_checksum_into`, for a 1-D uint8 host array."""
    n = data.size
    if data.ctypes.data % 8:
        data = data.copy()  # word views need 8-byte alignment
    words = n // 8
    rows = words // ROW_WORDS
    main = data[: words * 8].view(np.int64)
    total = np.int64(0)
    with np.errstate(over="ignore"):  # arithmetic is mod 2^64 on purpose
        if rows:
            row_sums = main[: rows * ROW_WORDS].reshape(rows, ROW_WORDS).sum(axis=1)
            total += (row_sums * np.arange(1, 2 * rows, 2, dtype=np.int64)).sum()
        if words > rows * ROW_WORDS:
            total += main[rows * ROW_WORDS:].sum() * np.int64(2 * rows + 1)
        if n > words * 8:
            tail = np.zeros(8, dtype=np.uint8)
            tail[: n - words * 8] = data[words * 8:]
            total += tail.view(np.int64)[0] * np.int64(2 * rows + 3)
    return int(total)


def device_checksum_into(buf: torch.Tensor, out: torch.Tensor) -> None:
    """The checksum with torch ops on buf's device (no host round trip)."""
    n = buf.numel()
    if buf.data_ptr() % 8 or not buf.is_contiguous():
        buf = buf.clone(memory_format=torch.contiguous_format)  # word views need 8-byte alignment
    words = n // 8
    rows = words // ROW_WORDS
    main = buf[: words * 8].view(torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=buf.device)
    if rows:
        row_sums = main[: rows * ROW_WORDS].view(rows, ROW_WORDS).sum(1)
        total += (row_sums * _row_weights(rows, buf.device)).sum()
    if words > rows * ROW_WORDS:
        total += main[rows * ROW_WORDS:].sum() * (2 * rows + 1)
    if n > words * 8:
        tail = torch.zeros(8, dtype=torch.uint8, device=buf.device)
        tail[: n - words * 8] = buf[words * 8:]
        total += tail.view(torch.int64)[0] * (2 * rows + 3)
    out.copy_(total.reshape(out.shape))


def checksum(buf: torch.Tensor) -> int:
    """The checksum as a Python int (synchronises; for tests and tools)."""
    out = torch.zeros(1, dtype=torch.int64, device=buf.device)
    checksum_into(buf, out)
    return int(out.item())
