"""What the executor and its worker processes say to each other: msgpack messages over a
socket, never pickle.

Executor -> worker:
    {"op": "init", ...}                     first message: config, model path, rank, TP port
    {"op": "step", "new", "items", "finished", "state_copies"}   one engine step, no reply
    {"op": "call", "call": bytes}           a typed call (calls.py), answered by one reply
    {"op": "load", "tensors": [[name, dtype, shape], ...], "call": bytes}   the tensors follow
                                            over the TP group (rank 0 broadcasts), then the worker
                                            runs the TensorCall with them; answered by one reply
    {"op": "shutdown"}
Worker -> executor:
    {"op": "reply", "ok": true, "result"} | {"op": "reply", "ok": false, "error": [type, message, param]}
    {"op": "fatal", "error"}                the worker is about to exit

A step carries the scheduler output as plain lists. Workers keep a mirror of every
request they have seen, so a step sends each request's tokens once: new requests with
their prompt and sampling parameters, then per scheduled request only the tokens appended
since the last step it was in (and the one it was still sampling then, now known); the
ids of requests that finished meanwhile (SchedulerOutput.finished_ids) let workers drop
their mirrors. A mirror is a rlserve.sequence.Sequence: what the model runner reads of a
request.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
from typing import Any

import msgpack

from rlserve.errors import WireError, from_wire, to_wire
from rlserve.sampling_params import SamplingParams
from rlserve.sequence import PLACEHOLDER, ScheduledRequest, SchedulerOutput, Sequence

_HEADER = struct.Struct("!Q")


class ChannelClosed(ConnectionError):
    """The other end went away (its process exited or closed the socket)."""


class Channel:
    """Length-prefixed msgpack messages over a stream socket; send is thread-safe."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        self.send_packed(msgpack.packb(message, use_bin_type=True))

    def send_packed(self, data: bytes) -> None:
        """Send a message already packed (to send one message to many channels)."""
        with self._send_lock:
            try:
                self.sock.sendall(_HEADER.pack(len(data)) + data)
            except OSError as e:
                raise ChannelClosed(f"send failed: {e}") from e

    def recv(self) -> dict[str, Any]:
        """Blocks for one message; only one thread may receive."""
        (n,) = _HEADER.unpack(self._read(_HEADER.size))
        return msgpack.unpackb(self._read(n), raw=False)

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except OSError as e:
                raise ChannelClosed(f"receive failed: {e}") from e
            if not chunk:
                raise ChannelClosed("connection closed")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# -- errors (their one registry: rlserve/errors.py) ---------------------------------------


def error_reply(e: BaseException) -> dict[str, Any]:
    return {"op": "reply", "ok": False, "error": list(to_wire(e))}


def error_from_reply(reply: dict[str, Any], rank: int) -> BaseException:
    """The worker's exception, as its own type (so an invalid update still answers 400),
    prefixed with the rank."""
    return from_wire(WireError(*reply["error"]), prefix=f"rank {rank}: ")


def reply_error_text(reply: dict[str, Any]) -> str:
    return WireError(*reply["error"]).message


# -- steps ------------------------------------------------------------------------------


def _request_to_wire(req: Sequence) -> list:
    params = dataclasses.asdict(req.sampling_params)
    if params["logit_bias"] is not None:  # msgpack maps take string keys; SamplingParams reads them back
        params["logit_bias"] = {str(k): v for k, v in params["logit_bias"].items()}
    return [req.request_id, req.prompt_token_ids, params, sorted(req.eos_token_ids), req.sample_index, req.lora_slot]


def _request_from_wire(w: list) -> Sequence:
    rid, prompt, params, eos, sample_index, lora_slot = w
    return Sequence(rid, list(prompt), SamplingParams(**params), frozenset(eos), sample_index, lora_slot)


class StepEncoder:
    """Executor side: scheduler output -> a step message, remembering what workers hold."""

    def __init__(self) -> None:
        # id -> (request, tokens sent, its LoRA slot then: a preempted request may come back
        # to another slot)
        self.known: dict[str, tuple[Sequence, int, int]] = {}

    def encode(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> dict[str, Any]:
        finished = [rid for rid in sched.finished_ids if self.known.pop(rid, None) is not None]
        new, items = [], []
        for item, table in zip(sched.scheduled, block_tables):
            req = item.request
            entry = self.known.get(req.request_id)
            if entry is None or entry[0] is not req or entry[1] > req.num_tokens or entry[2] != req.lora_slot:
                new.append(_request_to_wire(req))
                sent = req.num_prompt_tokens
            else:
                sent = entry[1]
            items.append(
                [
                    req.request_id,
                    req.num_computed_tokens,
                    item.num_new_tokens,
                    sent,
                    req.token_ids[sent:],
                    list(table),
                    req.state_slot,
                ]
            )
            # A token the step in flight is still sampling goes as a PLACEHOLDER (the worker
            # reads it from that step, as rank 0 does) and again, known, in the next message.
            known = req.num_tokens
            while known > sent and req.token_ids[known - 1] == PLACEHOLDER:
                known -= 1
            self.known[req.request_id] = (req, known, req.lora_slot)
        return {
            "op": "step",
            "new": new,
            "items": items,
            "finished": finished,
            "state_copies": [sched.state_loads, sched.state_saves],
        }


class StepDecoder:
    """Worker side: step message -> the same scheduler output, on mirrored requests."""

    def __init__(self) -> None:
        self.requests: dict[str, Sequence] = {}

    def decode(self, msg: dict[str, Any]) -> tuple[SchedulerOutput, list[list[int]]]:
        for rid in msg["finished"]:
            self.requests.pop(rid, None)
        for w in msg["new"]:
            req = _request_from_wire(w)
            self.requests[req.request_id] = req
        out, tables = SchedulerOutput(), []
        for rid, num_computed, num_new, start, tokens, table, state_slot in msg["items"]:
            req = self.requests[rid]
            del req.token_ids[start:]  # a PLACEHOLDER sent last time, now known
            req.token_ids.extend(tokens)
            req.num_computed_tokens = num_computed
            req.state_slot = state_slot  # a hybrid model's: it may change when preempted
            out.scheduled.append(ScheduledRequest(req, num_new))
            out.num_batched_tokens += num_new
            tables.append(table)
        loads, saves = msg["state_copies"]
        out.state_loads, out.state_saves = [tuple(c) for c in loads], [tuple(c) for c in saves]
        return out, tables
