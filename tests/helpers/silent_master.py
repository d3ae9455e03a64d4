"""A trainer's address that accepts TCP connections and never answers: a wedged trainer,
or a black hole. It records each connection, so a test can wait until the server is stuck
on it rather than guess how long that takes."""

from __future__ import annotations

import socket
import threading


class SilentMaster:
    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.port: int = self.sock.getsockname()[1]
        self.connections: list[socket.socket] = []  # held open, never answered
        threading.Thread(target=self._accept, name="silent-master", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.connections.append(conn)

    def close(self) -> None:
        """Stop accepting. The connections stay open: a store client still stuck on one (its
        C++ wait cannot be interrupted) keeps waiting quietly instead of retrying with warnings."""
        self.sock.close()
