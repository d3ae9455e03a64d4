"""The engine's typed answers to control calls keep the JSON vLLM clients read, after the
trip from the engine process; each error class answers with its own HTTP status."""

from __future__ import annotations

import json

import msgspec
import pytest

from rlserve import errors
from rlserve.server.responses import APIError
from rlserve.wire.control import Paused, WeightsUpdated, reply_type
from rlserve.wire.messages import AbortAll, CallResult, Pause, Resume, UpdateWeights, WeightsLayout


def _through_the_wire(body, value):
    """As the engine sends an answer and the front end's client reads it back."""
    sent = msgspec.msgpack.encode(CallResult(1, True, value))
    got = msgspec.msgpack.decode(sent, type=CallResult)
    return msgspec.convert(got.value, reply_type(body))


def test_an_update_answer_keeps_its_fields_and_their_order():
    applied = WeightsUpdated(message="Weights updated", weight_version=3, num_bytes=10, receive_seconds=0.5,
                             apply_seconds=0.25, skipped=0)
    staged = msgspec.structs.replace(applied, staged=True, part=2, apply_seconds=0.0)
    for answer in (applied, staged):
        back = _through_the_wire(UpdateWeights(None), answer)
        assert back == answer
    assert list(msgspec.to_builtins(applied)) == ["message", "weight_version", "num_bytes", "receive_seconds",
                                                  "apply_seconds", "skipped"]
    assert list(msgspec.to_builtins(staged))[:3] == ["message", "staged", "part"]
    # a data-parallel replica's entry leads with its index, as {"replica": i, **answer}
    entry = msgspec.to_builtins(msgspec.structs.replace(applied, replica=1))
    assert json.dumps(entry) == json.dumps({"replica": 1, **msgspec.to_builtins(applied)})


def test_a_pause_answer_names_kept_requests_only_when_there_are_some():
    assert msgspec.to_builtins(_through_the_wire(Pause(), Paused("abort"))) == {"mode": "abort"}
    assert msgspec.to_builtins(_through_the_wire(Pause(), Paused("keep", 3))) == {"mode": "keep", "kept": 3}


def test_calls_without_a_struct_answer_their_plain_value():
    assert _through_the_wire(WeightsLayout(), ["a", "b"]) == ["a", "b"]
    assert _through_the_wire(AbortAll(), 4) == 4
    assert _through_the_wire(Resume(), None) is None


@pytest.mark.parametrize("error, status", [
    (errors.InvalidRequestError("n: too large", "n"), 400),
    (errors.PayloadTooLargeError("update_info.shapes: too many", "update_info"), 413),
    (errors.ModelNotFoundError("model: 'x' is not served"), 404),
    (errors.ConflictError("a transfer is under way"), 409),
    (errors.EngineUnavailableError("paused"), 503),
    (errors.EngineDeadError("gone"), 503),
    (errors.InvalidUpdateError("update_info: names missing"), 400),
    (errors.WeightTransferError("timed out"), 502),
])
def test_every_error_class_answers_its_status_after_crossing_a_process(error, status):
    again = errors.from_wire(errors.to_wire(error))
    assert type(again) is type(error)
    answer = APIError.of(again)
    assert answer.status == status and answer.info.code == status
    assert answer.info.param == getattr(error, "param", None)
    assert str(error) in answer.info.message


def test_a_transfer_failure_says_the_old_weights_still_serve():
    answer = APIError.of(errors.WeightTransferError("the trainer vanished"))
    assert answer.info.type == "weight_transfer_error"
    assert answer.info.message == "weight transfer failed, previous weights still serving: the trainer vanished"
