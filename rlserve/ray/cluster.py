"""Rollout replicas on a Ray cluster, behind one OpenAI endpoint, with one push to all.

    import ray
    from rlserve.ray import RolloutCluster
    ray.init()
    cluster = RolloutCluster("Qwen/Qwen3-8B", num_replicas=4, tensor_parallel_size=2,
                             server_args=["--load-format", "dummy"])
    openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="EMPTY")   # rollouts
    cluster.push(model.named_parameters())                          # every replica, one group
    cluster.shutdown()

Placement: one placement group per replica, one bundle per GPU ({"GPU": 1, "CPU": 1},
STRICT_PACK: a replica's tensor-parallel ranks share one node), or one CPU bundle per
replica on CPU. The replica actor (replica.py) takes bundle 0 and starts the engine-core
process on the GPUs of all its bundles (the others are held by small GPUHolder actors).

The router is `rlserve serve --data-parallel-size N` started here, in this process's node
(the trainer's), attached over ZeroMQ/TCP to the engines (frontend/dp_client.py): it routes
requests, fans the control plane out, and answers at `cluster.url`. A replica whose engine
dies is taken out of rotation at once; this object's monitor thread starts a new engine in
the same actor and attaches it (`POST /replicas/{i}/attach`), which copies the current
weights from a healthy replica before it serves. `push` forms the trainer's transfer group
again whenever a replica has been replaced since the last one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import requests
import torch

from rlserve import envs
from rlserve.weight_transfer.address import get_ip, get_open_port
from rlserve.weight_transfer.trainer.client import WeightSyncClient

logger = logging.getLogger(__name__)


class RolloutCluster:
    def __init__(self, model: str, num_replicas: int = 1, tensor_parallel_size: int = 1, *,
                 device: str | None = None, backend: str | None = None,
                 server_args: Sequence[str] = (), port: int | None = None,
                 admin_key: str | None = None, num_cpus_per_replica: float = 1,
                 max_restarts: int = 3, log_dir: str | Path | None = None,
                 transfer_timeout_s: float = 120.0, start_timeout_s: float = 900.0):
        """`server_args`: more `rlserve serve` flags (--dtype, --max-model-len, --load-format,
        ...), for the router and every replica alike. `device`: cuda or cpu (default: cuda
        when the Ray cluster has GPUs). `backend`: the weight transfer, nccl on GPU, gloo
        on CPU by default."""
        import ray

        from rlserve.cli import build_parser, config_from_args

        if not ray.is_initialized():
            ray.init()
        if device is None:
            device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
        gpu = device.startswith("cuda")
        backend = backend or ("nccl" if gpu else "gloo")
        self._ray = ray
        self.num_replicas, self.tp, self.backend = num_replicas, tensor_parallel_size, backend
        self.admin_key, self.transfer_timeout_s = admin_key, transfer_timeout_s
        self.max_restarts = max_restarts
        self.log_dir = Path(log_dir) if log_dir is not None else None
        flags = [*server_args, "--device", "cuda:0" if gpu else "cpu",
                 "--tensor-parallel-size", str(tensor_parallel_size),
                 "--data-parallel-size", str(num_replicas),
                 "--weight-transfer-config", json.dumps({"backend": backend, "timeout_s": transfer_timeout_s})]
        if admin_key:
            flags += ["--admin-key", admin_key]
        # One reading of the flags for the router and the replicas.
        replica_config = config_from_args(build_parser().parse_args(["serve", model, *flags])).replica(0)
        self._place_replicas(replica_config.to_wire(), gpu, num_cpus_per_replica, start_timeout_s)
        self._start_router(model, flags, port, start_timeout_s)
        self._session = requests.Session()
        if admin_key:
            self._session.headers["Authorization"] = f"Bearer {admin_key}"
        self._sync: WeightSyncClient | None = None
        self._synced_restarts: tuple | None = None
        self._restarts = [0] * num_replicas
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="rlserve-ray-monitor", daemon=True)
        self._monitor.start()
        logger.info("rlserve: %d replica(s) of %d %s rank(s) serving at %s", num_replicas,
                    tensor_parallel_size, device, self.url)

    def _place_replicas(self, wire: dict, gpu: bool, num_cpus_per_replica: float, timeout_s: float) -> None:
        """A placement group per replica, its actor on bundle 0 and, on GPU, a GPUHolder on
        each other bundle; the actor is told every GPU of its group."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlserve.ray.replica import EngineReplica, GPUHolder

        ray, tp = self._ray, self.tp
        remote_replica, remote_holder = ray.remote(EngineReplica), ray.remote(GPUHolder)
        bundles = [{"GPU": 1, "CPU": 1}] * tp if gpu else [{"CPU": num_cpus_per_replica}]
        self.groups = [placement_group(bundles, strategy="STRICT_PACK", name=f"rlserve-replica-{i}")
                       for i in range(self.num_replicas)]
        ray.get([pg.ready() for pg in self.groups], timeout=timeout_s)
        self.actors, self.holders = [], []
        for i, pg in enumerate(self.groups):
            def on(bundle: int, pg=pg):
                return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
            actor = remote_replica.options(
                num_cpus=1 if gpu else num_cpus_per_replica, num_gpus=1 if gpu else 0,
                scheduling_strategy=on(0), name=f"rlserve-replica-{i}").remote(i, wire)
            holders = [remote_holder.options(num_cpus=0, num_gpus=1, scheduling_strategy=on(b)).remote()
                       for b in range(1, tp)] if gpu else []
            if gpu:
                ids = ray.get(actor.own_gpus.remote()) + [g for h in holders for g in ray.get(h.gpus.remote())]
                ray.get(actor.set_gpus.remote(ids))
            self.actors.append(actor)
            self.holders.append(holders)

    def _start_router(self, model: str, flags: list[str], port: int | None, timeout_s: float) -> None:
        """Start every replica's engine, then the router on this node, attached to them."""
        from rlserve.server.launcher import ServerProcess

        self.host = get_ip()
        outputs = [self._output_address() for _ in range(self.num_replicas)]
        inputs = self._ray.get([a.start.remote(out) for a, out in zip(self.actors, outputs)])
        engines = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
        self.port = port or get_open_port()
        log = self.log_dir / "router.log" if self.log_dir is not None else None
        self.router = ServerProcess(model, *flags, host="0.0.0.0", port=self.port, log=log,
                                    timeout_s=timeout_s, die_with_parent=True,
                                    env={envs.RLSERVE_DP_ENGINES.name: json.dumps(engines)})
        self.url = f"http://{self.host}:{self.port}"  # for rollouts, from any node
        # The control plane answers loopback clients only (without an admin key); the
        # router runs on this node.
        self.control_url = f"http://127.0.0.1:{self.port}"

    def _output_address(self) -> str:
        return f"tcp://{self.host}:{get_open_port()}"

    # -- state ---------------------------------------------------------------------------
    def replicas(self) -> list[dict]:
        """Each replica as the router sees it: state, weight version, pid, load, restarts."""
        r = self._session.get(f"{self.control_url}/replicas", timeout=30)
        r.raise_for_status()
        return r.json()["replicas"]

    def wait_until_serving(self, timeout_s: float = 600.0) -> None:
        """Until every replica serves (after a restart, say)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(r["state"] == "up" for r in self.replicas()):
                return
            time.sleep(0.5)
        raise TimeoutError(f"not every replica serves after {timeout_s:.0f}s: {self.replicas()}")

    # -- faults ----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            for i, actor in enumerate(self.actors):
                if self._stop.is_set():
                    return
                try:
                    alive = self._ray.get(actor.alive.remote(), timeout=30)
                except Exception as e:  # the actor itself is gone (its node, say)
                    logger.error("replica %d: its actor does not answer: %s", i, e)
                    continue
                if not alive and self._restarts[i] < self.max_restarts:
                    try:
                        self._restart(i)
                    except Exception as e:
                        logger.error("replica %d: restart failed: %s", i, e)

    def _restart(self, i: int) -> None:
        self._restarts[i] += 1
        deadline = time.monotonic() + 60
        while not any(r["replica"] == i and r["state"] == "down" for r in self.replicas()):
            if time.monotonic() > deadline or self._stop.is_set():
                raise TimeoutError("the router did not mark it down")
            time.sleep(0.2)
        output = self._output_address()
        address = self._ray.get(self.actors[i].start.remote(output))
        logger.info("replica %d: new engine at %s (restart %d)", i, address, self._restarts[i])
        r = self._session.post(f"{self.control_url}/replicas/{i}/attach", json={"input": address, "output": output},
                               timeout=3600)
        r.raise_for_status()

    # -- weights ---------------------------------------------------------------------------
    def push(self, named_parameters: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
             pause_mode: str = "keep", **kwargs):
        """Send the trainer's weights to every rank of every replica in one broadcast
        group (formed on first use, and again after a replica was replaced). Returns the
        WeightSyncClient's PushResult; per replica in `result.answers[0]["replicas"]`."""
        restarts = tuple(r["restarts"] for r in self.replicas())
        if self._sync is None or restarts != self._synced_restarts:
            self.wait_until_serving()
            if self._sync is None:
                self._sync = WeightSyncClient(self.control_url, backend=self.backend, admin_key=self.admin_key,
                                              timeout_s=self.transfer_timeout_s)
            self._sync.init()
            self._synced_restarts = tuple(r["restarts"] for r in self.replicas())
        return self._sync.push(named_parameters, version=version, pause_mode=pause_mode, **kwargs)

    # -- end -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._stop.set()
        self._monitor.join(timeout=35)
        if self._sync is not None and self._sync.group is not None and self.backend != "ipc":
            try:
                self._sync.group.close()
            except Exception:
                pass
        self.router.stop()
        from ray.util.placement_group import remove_placement_group
        for actor in self.actors:
            try:
                self._ray.get(actor.stop.remote(), timeout=30)
            except Exception:
                pass
            self._ray.kill(actor)
        for holders in self.holders:
            for h in holders:
                self._ray.kill(h)
        for pg in self.groups:
            remove_placement_group(pg)

    def __enter__(self) -> RolloutCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
