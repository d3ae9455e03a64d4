"""The engine-core process's way out: a sender thread encodes each message and sends it to
one API server, or to every one, so encoding never holds the step loop. With several API
servers, a step's outputs are split by the server each sample came from (`split_by_client`).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import msgspec
import zmq

from rlserve.wire.outputs import EngineCoreOutputs


class OutputSender:
    def __init__(self, ctx: zmq.Context, addresses: list[str]):
        self.ctx = ctx
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._send_loop, args=(addresses,), name="rlserve-engine-sender", daemon=True
        )
        self.thread.start()

    def _send_loop(self, addresses: list[str]) -> None:
        sockets = []
        for address in addresses:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the API server keeps up
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(address)
            sockets.append(sock)
        encode = msgspec.msgpack.Encoder().encode
        while True:
            item = self.outbox.get()
            if item is None:
                break
            client, message = item
            if client is None:
                for sock in sockets:
                    sock.send(encode(message), copy=False)
            else:
                sockets[client].send(encode(message), copy=False)
        for sock in sockets:
            sock.close()

    def send(self, client: int | None, message: Any) -> None:
        """Queue `message` for API server `client` (None: every one); thread-safe."""
        self.outbox.put((client, message))

    def close(self) -> None:
        """Send what is queued, then stop."""
        self.outbox.put(None)
        self.thread.join(timeout=5)


def split_by_client(out: EngineCoreOutputs, owners: dict[str, int]) -> dict[int, EngineCoreOutputs]:
    """One step's outputs, per API server (by the owner of each sample); a finished
    sample leaves `owners`."""
    parts: dict[int, EngineCoreOutputs] = {}

    def part(rid: str) -> EngineCoreOutputs:
        client = owners.get(rid, 0)
        p = parts.get(client)
        if p is None:
            p = parts[client] = EngineCoreOutputs(
                out.version, [], [], [] if out.logprobs is not None else None, timestamp=out.timestamp
            )
        return p

    for i, (rid, token) in enumerate(zip(out.request_ids, out.token_ids)):
        p = part(rid)
        p.request_ids.append(rid)
        p.token_ids.append(token)
        if p.logprobs is not None and out.logprobs is not None:  # both or neither
            p.logprobs.append(out.logprobs[i])
    for st in out.started:
        part(st.request_id).started.append(st)
    for f in out.finished:
        part(f.request_id).finished.append(f)
        owners.pop(f.request_id, None)
    return parts
