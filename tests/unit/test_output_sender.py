"""With several API servers (--api-server-count), the engine process sends each one the
tokens, starts and ends of the samples it sent, and every one what all must hear; the
sender thread delivers each server's messages in order, over real ZeroMQ sockets."""

from __future__ import annotations

import msgspec
import zmq

from rlserve.engine.output_sender import OutputSender, split_by_client
from rlserve.sequence import TokenLogprob, TopLogprobs
from rlserve.wire.messages import EngineDead, EngineOutput
from rlserve.wire.outputs import EngineCoreOutputs, Finished, Started


def _lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5, 1, TopLogprobs())


def test_a_steps_outputs_go_to_the_server_each_sample_came_from():
    out = EngineCoreOutputs(3, ["a-0", "b-0", "a-1", "c-0"], [11, 22, 33, 44], [_lp(11), None, _lp(33), None],
                            started=[Started("b-0", 0)], finished=[Finished("a-1", "stop")], timestamp=1.5)
    owners = {"a-0": 0, "a-1": 0, "b-0": 1}  # c-0 has no owner: the first server's
    parts = split_by_client(out, owners)
    assert parts == {
        0: EngineCoreOutputs(3, ["a-0", "a-1", "c-0"], [11, 33, 44], [_lp(11), _lp(33), None],
                             finished=[Finished("a-1", "stop")], timestamp=1.5),
        1: EngineCoreOutputs(3, ["b-0"], [22], [None], started=[Started("b-0", 0)], timestamp=1.5),
    }
    assert owners == {"a-0": 0, "b-0": 1}  # a finished sample's owner is forgotten


def test_a_step_without_logprobs_splits_without_them():
    out = EngineCoreOutputs(1, ["a-0", "b-0"], [5, 6])
    parts = split_by_client(out, {"a-0": 1, "b-0": 0})
    assert parts == {1: EngineCoreOutputs(1, ["a-0"], [5]), 0: EngineCoreOutputs(1, ["b-0"], [6])}


def test_the_sender_delivers_to_one_server_or_to_every_one_in_order():
    ctx = zmq.Context()
    pulls = [ctx.socket(zmq.PULL) for _ in range(2)]
    addresses = [f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}" for sock in pulls]
    sender = OutputSender(ctx, addresses)
    decoder = msgspec.msgpack.Decoder(EngineOutput)

    def received(sock: zmq.Socket, n: int) -> list:
        got = []
        for _ in range(n):
            assert sock.poll(10_000), f"{len(got)} of {n} messages arrived"
            got.append(decoder.decode(sock.recv()))
        return got

    try:
        sender.send(1, EngineCoreOutputs(1, ["b-0"], [7]))
        sender.send(None, EngineDead("the engine stopped"))
        sender.send(0, EngineCoreOutputs(2, ["a-0"], [8]))
        assert received(pulls[0], 2) == [EngineDead("the engine stopped"), EngineCoreOutputs(2, ["a-0"], [8])]
        assert received(pulls[1], 2) == [EngineCoreOutputs(1, ["b-0"], [7]), EngineDead("the engine stopped")]
    finally:
        sender.close()
        assert not sender.thread.is_alive()
        for sock in pulls:
            sock.close(linger=0)
        ctx.term()
