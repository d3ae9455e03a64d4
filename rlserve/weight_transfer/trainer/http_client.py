"""The trainer's HTTP calls to the server's control plane, and how their answers read."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import requests

from ..errors import UpdateRefusedError, WeightTransferError


class BackgroundCall(threading.Thread):
    """A control call that blocks until the matching collective completes: it runs on a
    thread while this process broadcasts. `result()` is its answer (a response's JSON)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        super().__init__(daemon=True)
        self.fn, self.args = fn, args
        self.value: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # raised by result()
            self.error = e

    def result(self) -> Any:
        self.join()
        if isinstance(self.error, WeightTransferError):
            raise self.error
        if self.error is not None:
            raise WeightTransferError(f"request failed: {self.error}") from self.error
        return answer(self.value) if isinstance(self.value, requests.Response) else self.value


def answer(r: requests.Response, refused: type[WeightTransferError] = WeightTransferError) -> dict:
    """A control endpoint's JSON, or its error message raised: a 400 as `refused` (the
    server changed nothing), any other failure as WeightTransferError."""
    if r.status_code < 400:
        return r.json()
    try:
        message = r.json()["error"]["message"]
    except Exception:
        message = r.text
    error = refused if r.status_code == 400 else WeightTransferError
    raise error(f"{r.request.url} answered {r.status_code}: {message}")


def post_update(url: str, update_info: dict, admin_key: str | None = None,
                timeout_s: float = 300.0, session: requests.Session | None = None) -> dict:
    """POST /update_weights and return its JSON; a 400 raises UpdateRefusedError (nothing
    changed on the server), anything else WeightTransferError."""
    http = session or requests
    headers = {"Content-Type": "application/json"}
    if admin_key:
        headers["Authorization"] = f"Bearer {admin_key}"
    # msgspec, not requests' json.dumps: an IPC document of a per-expert MoE checkpoint is
    # 2.6 MB, 25 ms through the json module and 4 ms here.
    body = msgspec.json.encode({"update_info": update_info})
    try:
        r = http.post(f"{url.rstrip('/')}/update_weights", data=body, headers=headers, timeout=timeout_s)
    except Exception as e:
        raise WeightTransferError(f"{url}/update_weights: {e}") from e
    return answer(r, refused=UpdateRefusedError)


class HTTPVLLMWeightSyncClient:
    """The control calls of one update, over the server's HTTP routes (vLLM's names): what
    WeightTransferTrainerFactory drives. Each call raises on an error answer, with the
    server's message (a 400 as UpdateRefusedError: the server changed nothing)."""

    def __init__(self, base_url: str, timeout: float = 300.0, admin_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
        self.session = requests.Session()

    def _call(self, method: str, path: str, json: dict | None = None) -> dict:
        try:
            r = self.session.request(method, f"{self.base_url}/{path}", json=json, headers=self.headers,
                                     timeout=self.timeout)
        except Exception as e:
            raise WeightTransferError(f"{self.base_url}/{path}: {e}") from e
        return answer(r, refused=UpdateRefusedError)

    def get_world_size(self) -> int:
        return self._call("GET", "get_world_size")["world_size"]

    def init_weight_transfer_engine(self, init_info: dict) -> dict:
        return self._call("POST", "init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self, is_checkpoint_format: bool = True) -> dict:
        return self._call("POST", "start_weight_update", {"is_checkpoint_format": is_checkpoint_format})

    def update_weights(self, update_info: dict) -> dict:
        return self._call("POST", "update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | int | None = None) -> dict:
        return self._call("POST", "finish_weight_update", {"weight_version": weight_version})
