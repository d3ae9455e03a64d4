"""A misbehaving trainer, a hostile network: the server refuses or fails cleanly, names the
problem, keeps serving its old weights bit for bit, and the next good push works.

A real server (gloo, CPU) and a real trainer process (tests/helpers/trainer_agent.py), driven
through the HTTP control plane of vLLM's RLHF-over-HTTP example.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open

from helpers.servers import start_server, stop_server
from helpers.silent_master import SilentMaster
from helpers.trainer_agent import TrainerProcess
from helpers.waiting import wait_until
from rlserve.weight_transfer import get_open_port

TIMEOUT_S = 6.0  # the server's transfer timeout
PROMPT = "The capital of France is"
BUCKET = 32 << 20  # SmolLM2's 540 MB in float32: 17 packed buckets


@pytest.fixture(scope="module")
def checkpoint(demo_model) -> str:
    return str(Path(demo_model) / "model.safetensors")


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("faults") / "server.log"
    cfg = json.dumps({"backend": "gloo", "timeout_s": TIMEOUT_S})
    srv = start_server(demo_model, log, "--weight-transfer-config", cfg, "--served-model-name", "m",
                       "--max-num-seqs", "8")
    yield srv
    stop_server(srv)


class Agent(TrainerProcess):
    def answer(self, timeout_s: float = 60) -> dict:
        answer = super().answer(timeout_s)
        assert answer, f"the trainer did not answer within {timeout_s}s (exit code {self.proc.poll()})"
        return answer


@pytest.fixture
def agent(checkpoint):
    a = Agent(checkpoint)
    yield a
    a.close()


def update_info(checkpoint: str, packed: bool = True, **extra) -> dict:
    with safe_open(checkpoint, "pt") as f:
        names = list(f.keys())
        slices = [f.get_slice(n) for n in names]
        shapes = [list(s.get_shape()) for s in slices]
        dtypes = [{"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[s.get_dtype()] for s in slices]
    return dict(names=names, dtype_names=dtypes, shapes=shapes, packed=packed,
                packed_buffer_size_bytes=BUCKET, **extra)


def post(url: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=timeout)


def in_thread(fn):
    """Run fn in a thread; box gets its "value" or its "error"."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except Exception as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def init(url: str, agent: Agent) -> None:
    port = get_open_port()
    t, box = in_thread(lambda: post(url, "/init_weight_transfer_engine", {"init_info": dict(
        master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)}))
    agent.send(op="init", port=port, timeout_s=TIMEOUT_S)
    assert agent.answer()["ok"]
    t.join(60)
    assert box["value"].status_code == 200, box["value"].text


def push(url: str, agent: Agent, info: dict, **cmd) -> tuple[httpx.Response, dict, float]:
    """/update_weights (in a thread, as vLLM's RLHF-over-HTTP example does) while the trainer sends."""
    started = time.monotonic()
    t, box = in_thread(lambda: post(url, "/update_weights", {"update_info": info}))
    agent.send(op="push", **{"packed": info["packed"], "bucket_bytes": BUCKET, **cmd})
    trainer = agent.answer()
    t.join(TIMEOUT_S * 4)
    assert "value" in box, "/update_weights did not answer"
    return box["value"], trainer, time.monotonic() - started


def state(url: str) -> tuple:
    """The weight version and greedy tokens with their logprobs: equal means bit-identical weights."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
        model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, return_token_ids=True))
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return r.json()["weight_version"], choice["token_ids"], choice["logprobs"]["token_logprobs"]


def good_push(url: str, agent: Agent, checkpoint: str, scale: float) -> None:
    before = state(url)
    r, trainer, seconds = push(url, agent, update_info(checkpoint), scale=scale)
    assert r.status_code == 200, r.text
    assert trainer["ok"], trainer
    assert seconds < TIMEOUT_S, seconds  # no timeout spent anywhere
    assert state(url)[0] == before[0] + 1


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("fault", ["short", "long", "altered"])
def test_damaged_bucket_fails_the_update_and_old_weights_keep_serving(server, agent, checkpoint, fault, packed):
    url = server.url
    init(url, agent)
    before = state(url)
    info = update_info(checkpoint, packed)
    r, trainer, seconds = push(url, agent, info, scale=0.01, fault=fault, at=3)
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert "bucket 3/" in message, message
    if packed:  # bucket 3 of 32 MiB ones starts a few tensors in
        assert "model.layers." in message, message
    else:  # one tensor per bucket: the third in the checkpoint's order
        assert info["names"][2] in message, message
    assert seconds < TIMEOUT_S + 5, seconds
    # The trainer hears of it too: its push raises (for a flipped byte, the server's words).
    assert trainer.get("error") == "WeightTransferError", trainer
    if fault == "altered":
        assert "does not match the trainer's checksum" in trainer["message"], trainer
    assert httpx.get(f"{url}/health").status_code == 200  # the server is up
    assert state(url) == before  # same version, same tokens, same logprobs
    # A fresh init and a good push then work.
    init(url, agent)
    good_push(url, agent, checkpoint, scale=0.0)


@pytest.mark.parametrize("fault, status, names", [
    ("plan-not-json", 400, "plan message is not JSON"),
    ("plan-list", 400, "plan message must be a JSON object"),
    ("plan-missing", 400, "plan message is malformed"),
    ("go-not-json", 502, "go message is malformed"),
    ("go-list", 502, "go message is malformed"),
])
def test_malformed_trainer_messages_are_named_never_500(server, agent, checkpoint, fault, status, names):
    url = server.url
    init(url, agent)
    before = state(url)
    r, trainer, seconds = push(url, agent, update_info(checkpoint), fault=fault, scale=0.02)
    assert r.status_code == status, r.text
    assert names in r.json()["error"]["message"]
    assert "error" in trainer and seconds < TIMEOUT_S + 5, (trainer, seconds)
    assert state(url) == before
    if status == 502:  # the receiver could not tell whether bytes would follow: a new group
        init(url, agent)
    good_push(url, agent, checkpoint, scale=0.0)


def test_refusals_keep_both_sides_in_step(server, agent, checkpoint):
    url = server.url
    init(url, agent)
    info = update_info(checkpoint)
    bad = dict(info, names=["model.not_a_weight"] + info["names"][1:])
    # Refused with no trainer sending: answered within the grace, and the turn is void.
    started = time.monotonic()
    r = post(url, "/update_weights", {"update_info": bad})
    assert r.status_code == 400 and "model.not_a_weight" in r.json()["error"]["message"]
    assert time.monotonic() - started < TIMEOUT_S
    good_push(url, agent, checkpoint, scale=0.0)
    # Refused while the trainer sends (it pushes what update_info says it would not): the
    # trainer raises the server's message at once, and the group carries the next push.
    r, trainer, seconds = push(url, agent, dict(info, packed=False), packed=True)
    assert r.status_code == 400, r.text
    assert trainer["error"] == "UpdateRefusedError" and trainer["message"] == r.json()["error"]["message"]
    assert "does not match what the trainer sends" in trainer["message"]
    assert seconds < TIMEOUT_S / 2
    # Refused before the handshake (a weight_version past 64 bits; "x" is a label now, as
    # in vLLM) with a trainer sending: it hears so, and the next push still pairs with the
    # next request.
    r, trainer, seconds = push(url, agent, dict(info, weight_version=2**70))
    assert r.status_code == 400 and trainer["error"] == "UpdateRefusedError", (r.text, trainer)
    assert seconds < TIMEOUT_S / 2
    good_push(url, agent, checkpoint, scale=0.0)


def test_init_is_validated_and_bounded(server, agent):
    url = server.url
    body = dict(master_port=get_open_port(), rank_offset=1, world_size=2)
    for address in ["not a host!", "999.1.1.1", "0.0.0.0", "224.0.0.1", "-bad-.example", ""]:
        started = time.monotonic()
        r = post(url, "/init_weight_transfer_engine", {"init_info": dict(body, master_address=address)})
        assert r.status_code == 400, (address, r.text)
        assert "master_address" in r.json()["error"]["message"]
        assert time.monotonic() - started < 2
    r = post(url, "/init_weight_transfer_engine", {"init_info": dict(body, master_address="no-such-host.invalid")})
    assert r.status_code == 400 and "does not resolve" in r.json()["error"]["message"], r.text
    # A port that answers something else: the server's own HTTP port, a silent acceptor.
    silent = SilentMaster()
    for port in [int(url.rsplit(":", 1)[1]), silent.port]:
        started = time.monotonic()
        r = post(url, "/init_weight_transfer_engine", {"init_info": dict(
            body, master_address="127.0.0.1", master_port=port)})
        assert r.status_code == 502, r.text
        assert time.monotonic() - started < TIMEOUT_S + 3, (port, time.monotonic() - started)
    silent.close()
    # A stuck init does not hold up the next one.
    init(url, agent)


def test_a_new_init_replaces_one_stuck_on_a_silent_master(server, agent, checkpoint):
    """The trainer restarted while the server still waits on its old address: the new
    /init_weight_transfer_engine is not held up, and the old one answers at once."""
    url = server.url
    silent = SilentMaster()
    started = time.monotonic()
    stuck, stuck_box = in_thread(lambda: post(url, "/init_weight_transfer_engine", {"init_info": dict(
        master_address="127.0.0.1", master_port=silent.port, rank_offset=1, world_size=2)}))
    wait_until(lambda: silent.connections, 60, "the server connects to the silent master")
    init(url, agent)
    stuck.join(30)
    assert stuck_box["value"].status_code == 502, stuck_box["value"].text
    assert time.monotonic() - started < TIMEOUT_S  # neither waited for the timeout
    silent.close()
    r, answer, _ = push(url, agent, update_info(checkpoint))
    assert r.status_code == 200 and answer["ok"], r.text


# -- the worker's side of refusals and inits (what the engine calls) ---------------------

@pytest.fixture(scope="module")
def worker(demo_model):
    from rlserve.config import EngineConfig
    from rlserve.model.loader import load_hf_config
    from rlserve.worker.worker import Worker
    cfg = EngineConfig(model=demo_model, device="cpu", dtype="float32", load_format="dummy")
    w = Worker(cfg, load_hf_config(demo_model), demo_model)
    yield w
    w.receiver.close()


def worker_init(worker, agent: Agent, port: int | None = None) -> None:
    port = port or get_open_port()
    t, box = in_thread(lambda: worker.receiver.join("gloo", dict(
        master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2), TIMEOUT_S))
    agent.send(op="init", port=port, timeout_s=TIMEOUT_S)
    assert agent.answer()["ok"]
    t.join(30)
    assert "value" in box, box


def worker_push(worker, agent: Agent, info: dict) -> None:
    t, box = in_thread(lambda: worker.receiver.receive(info))
    agent.send(op="push", packed=True, bucket_bytes=BUCKET)
    assert agent.answer()["ok"]
    t.join(30)
    assert box.get("value") == sum(4 * math.prod(s) for s in info["shapes"]), box
    worker.receiver.drop()


def test_worker_refusal_before_the_handshake_tells_the_trainer_at_once(worker, agent, checkpoint):
    from rlserve.weight_transfer.handshake import REFUSAL_GRACE_S
    worker_init(worker, agent)
    info = update_info(checkpoint)
    message = "the server is asleep: POST /wake_up before updating weights"
    # The engine refuses while the trainer sends: the trainer raises that message at once.
    t, _ = in_thread(lambda: worker.receiver.refuse(message))
    agent.send(op="push", packed=True, bucket_bytes=BUCKET)
    trainer = agent.answer()
    t.join(10)
    assert trainer["error"] == "UpdateRefusedError" and trainer["message"] == message
    assert trainer["seconds"] < TIMEOUT_S / 2
    # With no trainer, the refusal gives up after the grace; neither leaves the group out of step.
    started = time.monotonic()
    worker.receiver.refuse("update_info.weight_version: must be an integer")
    assert time.monotonic() - started < REFUSAL_GRACE_S + 1
    worker_push(worker, agent, info)


def test_one_receive_at_a_time(worker, agent, checkpoint):
    from rlserve.weight_transfer import InvalidUpdateError
    worker_init(worker, agent)
    info = update_info(checkpoint)
    t, box = in_thread(lambda: worker.receiver.receive(info))
    wait_until(lambda: worker.receiver.busy, 60, "the first receive holds the worker")
    with pytest.raises(InvalidUpdateError, match="another weight update is in progress"):
        worker.receiver.receive(info)
    agent.send(op="push", packed=True, bucket_bytes=BUCKET)
    assert agent.answer()["ok"]
    t.join(30)
    assert box.get("value"), box  # the first one got the push
    worker.receiver.drop()


def test_a_new_init_stops_a_stuck_one(worker, agent, checkpoint):
    from rlserve.weight_transfer import WeightTransferError
    silent = SilentMaster()
    t, box = in_thread(lambda: worker.receiver.join("gloo", dict(
        master_address="127.0.0.1", master_port=silent.port, rank_offset=1, world_size=2), 120.0))
    # Stuck in the store's handshake with a master that never answers.
    wait_until(lambda: silent.connections, 60, "the worker connects to the silent master")
    assert t.is_alive()
    started = time.monotonic()
    worker_init(worker, agent)
    t.join(5)
    assert isinstance(box.get("error"), WeightTransferError), box
    assert "replaced by a newer" in str(box["error"])
    assert time.monotonic() - started < 15
    silent.close()
    worker_push(worker, agent, update_info(checkpoint))
