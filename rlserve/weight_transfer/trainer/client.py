"""One-call weight sync for trainers: pause, transfer, load, resume.

    client = WeightSyncClient("http://localhost:8000", backend="gloo")
    client.init()
    result = client.push(model.named_parameters())   # PushResult(bytes, seconds, gb_per_s, ...)

It performs the choreography of vLLM's RLHF-over-HTTP example (HTTP calls in threads while this process
broadcasts) for one server or several replicas, which then share one transfer group.
With backend="ipc" (trainer and servers on one GPU) there is no group: each server opens
this process's CUDA IPC handles once and copies from them on every push.

Devices: a push goes out from the device its tensors are on (tensors spread over several
devices are refused). NCCL binds a group to one GPU: give `device=` (constructor or
init), or let the first push form the group on its tensors' GPU; a later push from
another GPU forms a new group there.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import requests
import torch

from rlserve.weight_transfer.address import get_open_port, rendezvous_address
from rlserve.weight_transfer.errors import UpdateRefusedError, WeightTransferError
from rlserve.weight_transfer.info import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, is_reference
from rlserve.weight_transfer.trainer.http_client import BackgroundCall, answer, post_update


@dataclass
class PushResult:
    num_bytes: int
    seconds: float  # pause to resume, as the trainer sees it
    transfer_seconds: float  # the update as the trainer sees it: sent, received and loaded
    weight_versions: list[int]  # one per server
    send_seconds: float | None = None  # this process's trainer_send_weights alone (nccl, gloo)
    answers: list[dict] | None = None  # each server's /update_weights answer (per replica under "replicas")

    @property
    def gb_per_second(self) -> float:
        return self.num_bytes / max(self.transfer_seconds, 1e-9) / 1e9


def _engine_for(backend: str):
    from rlserve.weight_transfer.trainer.gloo import GlooWeightTransferEngine
    from rlserve.weight_transfer.trainer.ipc_sender import IPCWeightTransferEngine
    from rlserve.weight_transfer.trainer.nccl import NCCLWeightTransferEngine
    engines = {"nccl": NCCLWeightTransferEngine, "gloo": GlooWeightTransferEngine,
               "ipc": IPCWeightTransferEngine}
    if backend not in engines:
        raise ValueError(f"backend: must be one of {', '.join(engines)}, got {backend!r}")
    return engines[backend]


class WeightSyncClient:
    def __init__(self, base_urls: str | list[str], backend: str = "nccl", *,
                 admin_key: str | None = None, timeout_s: float = 300.0,
                 master_address: str | None = None, master_port: int | None = None,
                 device: torch.device | str | None = None):
        self.urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        self.urls = [u.rstrip("/") for u in self.urls]
        self.backend = backend
        self.engine = _engine_for(backend)
        self.timeout_s = timeout_s
        self.master_address = master_address
        self.master_port = master_port
        self.session = requests.Session()
        if admin_key:
            self.session.headers["Authorization"] = f"Bearer {admin_key}"
        self.group: Any = None  # a TransferGroup (nccl, gloo); one IPCSender per server (ipc)
        self.device = None if device is None else torch.device(device)
        self._sizes: list[int] | None = None  # the servers' world sizes, once asked

    def _post(self, url: str, path: str, json: dict | None = None, params: dict | None = None):
        return self.session.post(f"{url}{path}", json=json, params=params, timeout=self.timeout_s)

    def _check(self, r: requests.Response) -> dict:
        return answer(r)

    def init(self, device: torch.device | str | None = None) -> None:
        """Form one transfer group: this trainer at rank 0, each server's workers after it.
        ipc: no group; each server gets its own export of the handles. nccl without a
        device (here or in the constructor): the first push forms it on its tensors' GPU."""
        if device is not None:
            self.device = torch.device(device)
        if self.backend == "ipc":
            for u in self.urls:
                self._check(self._post(u, "/init_weight_transfer_engine", {"init_info": {}}))
            self.group = [self.engine.trainer_init() for _ in self.urls]
            return
        self._sizes = [self._check(self.session.get(f"{u}/get_world_size", timeout=30))["world_size"]
                       for u in self.urls]
        if self.backend == "nccl" and self.device is None:
            return
        self._form_group()

    def _form_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        sizes = self._sizes
        assert sizes is not None  # init asked the servers
        world_size = 1 + sum(sizes)
        address = self.master_address or rendezvous_address(self.urls)
        port = self.master_port or get_open_port()
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        calls = [BackgroundCall(self._post, u, "/init_weight_transfer_engine",
                       {"init_info": dict(master_address=address, master_port=port,
                                          rank_offset=off, world_size=world_size)})
                 for u, off in zip(self.urls, offsets)]
        try:
            self.group = self.engine.trainer_init(dict(master_address=address, master_port=port,
                                                       world_size=world_size, timeout_s=self.timeout_s),
                                                  device=self.device)
        finally:
            errors = []
            for c in calls:
                try:
                    c.result()
                except WeightTransferError as e:
                    errors.append(str(e))
        if errors:
            raise WeightTransferError("; ".join(errors))

    def _group_for(self, tensors) -> None:
        """NCCL: the group lives on the tensors' GPU (formed, or formed again, here)."""
        from rlserve.weight_transfer.trainer.engine import tensors_device
        device = tensors_device([t for _, t in tensors])
        if self.backend != "nccl" or device is None:
            return
        if device.type != "cuda":
            raise ValueError(f"the nccl backend sends CUDA tensors; these are on {device}")
        if self.group is None or self.group.device != device:
            self.device = device
            self._form_group()

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
             pause_mode: str = "keep", packed: bool | None = None,
             packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
             packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS, checksum: bool = True) -> PushResult:
        """Pause every server, send the tensors, load them, resume. All or nothing per server:
        a failure leaves that server on its previous weights and raises here.
        `checksum=False` sends no bucket checksums (nccl, gloo; for measuring their cost)."""
        return self._push([(n, t.detach()) for n, t in named_tensors], {}, version, pause_mode, packed,
                          packed_buffer_size_bytes, packed_num_buffers, checksum)

    def push_lora(self, adapter_name: str, peft_model, version: int | None = None,
                  pause_mode: str = "keep", adapter: str | None = None, packed: bool | None = None,
                  checksum: bool = True, lora_config: dict | None = None) -> PushResult:
        """Push a PEFT model's LoRA adapter (its active one, or `adapter`) to the servers
        as the adapter `adapter_name`: only its lora_A / lora_B tensors and its config
        travel. The adapter is created if the servers do not have it yet (a free slot
        needed), else replaced; requests then pick it by `model=adapter_name`. Same
        guarantees as `push`: validated before any byte moves (unknown modules, ranks
        and shapes refused), all or nothing, a new weight version.

        With `lora_config` (PEFT's adapter_config fields), `peft_model` may instead be
        (PEFT name, tensor) pairs, e.g. a training framework's adapter state dict."""
        from rlserve.model.peft import canonical_peft_names, peft_adapter_tensors
        if lora_config is not None:
            config = dict(lora_config)
            tensors = [(n, t.detach()) for n, t in canonical_peft_names(
                peft_model.named_parameters() if hasattr(peft_model, "named_parameters") else peft_model)]
        else:
            config, tensors = peft_adapter_tensors(peft_model, adapter)
        return self._push(tensors, {"lora_name": adapter_name, "lora_config": config}, version, pause_mode,
                          packed, DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, checksum)

    def _push(self, tensors: list[tuple[str, torch.Tensor]], extra: dict, version: int | None,
              pause_mode: str, packed: bool | None, packed_buffer_size_bytes: int,
              packed_num_buffers: int, checksum: bool) -> PushResult:
        """`extra`: further update_info fields (a LoRA adapter's name and config)."""
        if self.group is None and self._sizes is None:
            raise WeightTransferError("call init() before push()")
        if packed is None:
            # Measured (benchmarks/RESULTS.md): over gloo on CPU one broadcast per tensor
            # beats packing, whose host copies cost more than they save.
            packed = self.backend != "gloo"
        if self.backend != "ipc":
            self._group_for(tensors)
        update_info = dict(names=[n for n, _ in tensors],
                           dtype_names=[str(t.dtype).split(".")[-1] for _, t in tensors],
                           shapes=[list(t.shape) for _, t in tensors], packed=packed,
                           packed_buffer_size_bytes=packed_buffer_size_bytes,
                           packed_num_buffers=packed_num_buffers, **extra)
        if version is not None:
            update_info["weight_version"] = version
        num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        t0 = time.perf_counter()
        paused = []
        try:
            for u in self.urls:
                # The update resets the prefix cache itself; a keep-pause keeps the frozen
                # requests' KV (the server's default, vLLM's, would drop it).
                self._check(self._post(u, "/pause", params={"mode": pause_mode, "clear_cache": "false"}))
                paused.append(u)
            t1 = time.perf_counter()
            send_seconds = None
            if self.backend == "ipc":
                results = self._send_ipc(tensors, version, extra)
            else:
                results, send_seconds = self._send_collective(
                    tensors, update_info, packed, packed_buffer_size_bytes, packed_num_buffers, checksum)
            t2 = time.perf_counter()
        finally:
            for u in paused:
                self._check(self._post(u, "/resume"))
        return PushResult(num_bytes, time.perf_counter() - t0, t2 - t1,
                          [r["weight_version"] for r in results], send_seconds, results)

    def _send_collective(self, tensors, update_info, packed, packed_buffer_size_bytes,
                         packed_num_buffers, checksum) -> tuple[list[dict], float]:
        """Every server's /update_weights in a thread while this process broadcasts."""
        calls = [BackgroundCall(self._post, u, "/update_weights", {"update_info": update_info})
                 for u in self.urls]
        send_error = None
        started = time.perf_counter()
        try:
            self.engine.trainer_send_weights(iterator=iter(tensors), group=self.group, packed=packed,
                                             packed_buffer_size_bytes=packed_buffer_size_bytes,
                                             packed_num_buffers=packed_num_buffers, checksum=checksum)
        except Exception as e:
            send_error = e
        send_seconds = time.perf_counter() - started
        results, errors = [], []
        for c in calls:
            try:
                results.append(c.result())
            except WeightTransferError as e:
                errors.append(str(e))
        if errors or send_error is not None:
            # Refused before any byte moved (every server said so to the sender): nothing changed.
            error = UpdateRefusedError if isinstance(send_error, UpdateRefusedError) else WeightTransferError
            raise error("; ".join(errors) or str(send_error)) from send_error
        return results, send_seconds

    def _send_ipc(self, tensors, version: int | None, extra: dict) -> list[dict]:
        """Each server copies from this process's memory; its answer means the copy is done."""
        channel = extra.get("lora_name")  # the base weights, or one adapter
        results = []
        for url, sender in zip(self.urls, self.group):
            info = {**sender.update_info(tensors, version, channel=channel, reference=True), **extra}
            try:  # the session carries the admin key
                result = post_update(url, info, timeout_s=self.timeout_s, session=self.session)
            except UpdateRefusedError as e:
                if not (is_reference(info) and "ipc_handles.same_as" in str(e)):
                    raise
                sender.forget(channel)  # the server lost the document: send it whole
                info = {**sender.update_info(tensors, version, channel=channel), **extra}
                result = post_update(url, info, timeout_s=self.timeout_s, session=self.session)
            sender.accepted(info, channel)
            results.append(result)
        return results
