"""rlserve.ray on a local Ray cluster (`ray.init()`), two CPU replicas of the tiny model
over gloo: requests spread over both, one push updates both (greedy equals transformers),
a replica's engine killed with SIGKILL is replaced and serves the current weights, and the
next push reaches it. Skipped when ray is not installed (`pip install rlserve[ray]`)."""

from __future__ import annotations

import os
import signal

import pytest

from helpers.data_parallel import (
    PROMPTS,
    assert_replica_serves,
    complete,
    complete_all,
    health,
    hf_greedy,
    routed,
    trainer_model,
    wait_for,
)

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from rlserve.model.demo_model import demo_model_path
    from rlserve.model.presets import model_dir
    from rlserve.ray import RolloutCluster
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    c = RolloutCluster(model_dir("tiny"), num_replicas=2, tensor_parallel_size=1, device="cpu",
                       server_args=["--load-format", "dummy", "--tokenizer", demo_model_path(),
                                    "--served-model-name", "m", "--dtype", "float32",
                                    "--max-model-len", "1024"],
                       log_dir=tmp_path_factory.mktemp("ray"), transfer_timeout_s=30)
    yield c
    c.shutdown()
    if started_ray:
        ray.shutdown()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rlserve.model.demo_model import demo_model_path
    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def trainer():
    from rlserve.model.presets import model_dir
    return trainer_model(model_dir("tiny"), seed=1)


def test_cluster_serves_and_one_push_updates_both(cluster, trainer, tokenizer):
    import httpx
    assert httpx.get(f"{cluster.control_url}/get_world_size").json() == {"world_size": 2}
    result = cluster.push(trainer.named_parameters(), version=3)
    assert [(r["replica"], r["weight_version"]) for r in result.answers[0]["replicas"]] == [(0, 3), (1, 3)]
    before = routed(cluster.url)
    got = complete_all(cluster.url, PROMPTS)
    after = routed(cluster.url)
    assert all(after[i] > before[i] for i in (0, 1)), (before, after)
    for p in PROMPTS:
        assert got[p]["weight_version"] == 3
        assert got[p]["choices"][0]["token_ids"] == hf_greedy(trainer, tokenizer.encode(p)), p


def test_killed_engine_is_replaced_with_current_weights(cluster, trainer, tokenizer):
    url = cluster.url
    victim = cluster.replicas()[1]
    os.kill(victim["pid"], signal.SIGKILL)
    r = wait_for(lambda: (lambda x: x if x.json()["replicas"][1]["state"] != "up" else None)(health(url)),
                 30, "replica 1 out of rotation")
    assert r.status_code == 200 and r.json()["serving"] >= 1
    assert complete(url, PROMPTS[0])["choices"][0]["token_ids"] == hf_greedy(trainer, tokenizer.encode(PROMPTS[0]))

    cluster.wait_until_serving(timeout_s=240)
    back = cluster.replicas()[1]
    assert back["pid"] != victim["pid"] and back["weight_version"] == 3 and back["restarts"] == 1
    assert_replica_serves(url, 1, 3, trainer, tokenizer)

    # The next push forms the group again, the new engine in it.
    result = cluster.push(trainer.named_parameters(), version=4)
    assert [r["weight_version"] for r in result.answers[0]["replicas"]] == [4, 4]
