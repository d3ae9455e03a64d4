"""The gloo backend's data plane: one framed TCP stream from the trainer to each receiver.

gloo aborts the whole process (an enforce in its I/O thread) when a peer sends a message
longer than the receive posted for it, and silently accepts a shorter one; a server must
survive any trainer. So the CPU backend moves bytes over plain TCP instead: every message
is a frame that states its length, and a receiver reads exactly the bytes it expects
straight into its buffer, or fails with an error that says what arrived. Nothing a
trainer sends can write past a buffer or end the server process.

Frame: b"RLWT", u32 frame number (counted per direction of a connection), u64 payload
length, payload. A receiver's first frame is its hello (JSON: session, rank); the
trainer answers with frame 0 (JSON: ok or error). Sends and receives run on one thread
per connection, in order, so the caller packs or checks bucket k+1 while bucket k moves.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

MAGIC = b"RLWT"
HEADER = struct.Struct("<4sIQ")
MAX_HELLO_BYTES = 4096
_CHUNK = 64 << 20


class FrameError(RuntimeError):
    """The peer sent something other than the frame expected (or went away)."""


def _memoryview(buf: torch.Tensor) -> memoryview:
    if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise TypeError("frames carry contiguous uint8 CPU tensors")
    # numpy's stubs declare ndarray's buffer protocol only from Python 3.12 on.
    return memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        except TimeoutError as e:
            raise FrameError(f"no data for {sock.gettimeout():g}s ({got} of {n} bytes arrived)") from e
        except ConnectionResetError as e:
            # A peer that closes with bytes still unread sends a reset, not an end of stream.
            raise FrameError(f"the peer closed the connection (reset) after {got} of {n} bytes") from e
        except OSError as e:
            raise FrameError(f"connection failed after {got} of {n} bytes: {e}") from e
        if k == 0:
            raise FrameError(f"the peer closed the connection after {got} of {n} bytes")
        got += k


def _send_frame(sock: socket.socket, number: int, payload: memoryview | bytes) -> None:
    try:
        sock.sendall(HEADER.pack(MAGIC, number & 0xFFFFFFFF, len(payload)))
        if len(payload):
            sock.sendall(payload)
    except TimeoutError as e:
        raise FrameError(f"the peer took no data for {sock.gettimeout():g}s") from e
    except (BrokenPipeError, ConnectionResetError) as e:
        raise FrameError(f"the peer closed the connection: {e}") from e
    except OSError as e:
        raise FrameError(f"sending failed: {e}") from e


def _recv_header(sock: socket.socket, number: int) -> int:
    head = bytearray(HEADER.size)
    _recv_exact(sock, memoryview(head))
    magic, got_number, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"expected a frame header, got bytes {bytes(head[:8])!r}... "
                         "(the peer sent more bytes than its previous frame announced, or is not a trainer)")
    if got_number != number & 0xFFFFFFFF:
        raise FrameError(f"expected frame #{number}, got frame #{got_number}")
    return length


def _recv_frame_into(sock: socket.socket, number: int, view: memoryview) -> None:
    length = _recv_header(sock, number)
    if length != len(view):
        raise FrameError(f"frame #{number} carries {length} bytes, {len(view)} were announced")
    _recv_exact(sock, view)


def _recv_json(sock: socket.socket, number: int) -> dict:
    length = _recv_header(sock, number)
    if length > MAX_HELLO_BYTES:
        raise FrameError(f"control frame of {length} bytes (at most {MAX_HELLO_BYTES})")
    data = bytearray(length)
    _recv_exact(sock, memoryview(data))
    try:
        value = json.loads(data)
    except ValueError as e:
        raise FrameError(f"control frame is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise FrameError(f"control frame must be a JSON object, got {type(value).__name__}")
    return value


class Frames:
    """Pending frames (one per connection); `wait` raises the first failure."""

    def __init__(self, futures: list[Future]):
        self.futures = futures

    def wait(self, timeout_s: float) -> bool:
        """True once every frame is through; False if the time ran out first."""
        deadline = time.monotonic() + timeout_s
        for f in self.futures:
            try:
                f.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
        return True


class _Conn:
    def __init__(self, sock: socket.socket, name: str):
        self.sock = sock
        self.sent = 0  # frame numbers, per direction
        self.received = 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv/send
        except OSError:
            pass
        self.sock.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class TcpHub:
    """The trainer's end: a listener, then one connection per receiving rank."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        self.listener = socket.create_server(("", 0), family=family, dualstack_ipv6=family == socket.AF_INET6)
        self.port = self.listener.getsockname()[1]
        self.conns: dict[int, _Conn] = {}
        self._lock = threading.Lock()

    def accept(self, ranks: range, session: str, deadline: float, cancelled: threading.Event) -> None:
        """Accept one connection per rank (stray or malformed ones are dropped)."""
        while len(self.conns) < len(ranks):
            if cancelled.is_set():
                raise FrameError("cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in ranks if r not in self.conns]
                raise FrameError(f"receiver rank(s) {missing} did not open their data connection")
            self.listener.settimeout(min(left, 0.5))
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(min(max(left, 0.1), 10.0))
            try:
                hello = _recv_json(sock, 0)
                rank: Any = hello.get("rank")  # the peer's JSON, checked next
                if hello.get("session") != session or rank not in ranks or rank in self.conns:
                    raise FrameError(f"unexpected hello {hello!r}")
                _send_frame(sock, 0, json.dumps({"ok": True}).encode())
            except FrameError:
                sock.close()
                continue
            sock.settimeout(self.timeout_s)
            with self._lock:
                self.conns[rank] = _Conn(sock, f"rlserve-send-r{rank}")
                self.conns[rank].sent = 1

    def send(self, buf: torch.Tensor) -> Frames:
        """Queue `buf` as the next frame to every receiver."""
        view = _memoryview(buf)
        futures = []
        for conn in self.conns.values():
            number, conn.sent = conn.sent, conn.sent + 1
            futures.append(conn.pool.submit(_send_frame, conn.sock, number, view))
        return Frames(futures)

    def close(self) -> None:
        with self._lock:
            conns, self.conns = list(self.conns.values()), {}
        for conn in conns:
            conn.close()
        self.listener.close()


class TcpLink:
    """A receiver's end: one connection to the trainer's hub."""

    def __init__(self, address: str, port: int, session: str, rank: int, deadline: float, timeout_s: float):
        left = max(0.1, deadline - time.monotonic())
        try:
            sock = socket.create_connection((address, port), timeout=min(left, 10.0))
        except OSError as e:
            raise FrameError(f"cannot open the data connection to {address}:{port}: {e}") from e
        try:
            _send_frame(sock, 0, json.dumps({"session": session, "rank": rank}).encode())
            answer = _recv_json(sock, 0)
            if not answer.get("ok"):
                raise FrameError(f"the trainer refused the data connection: {answer}")
        except BaseException:
            sock.close()
            raise
        sock.settimeout(timeout_s)
        self.conn = _Conn(sock, f"rlserve-recv-r{rank}")
        self.conn.received = 1

    def recv(self, buf: torch.Tensor) -> Frames:
        """Queue a read of the next frame into `buf`; its length must be exactly buf's."""
        view = _memoryview(buf)
        number, self.conn.received = self.conn.received, self.conn.received + 1
        return Frames([self.conn.pool.submit(_recv_frame_into, self.conn.sock, number, view)])

    def close(self) -> None:
        self.conn.close()
