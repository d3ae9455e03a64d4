"""The trainer's HTTP calls to the server's control plane, and how their answers read."""

from __future__ import annotations

import requests

from .errors import UpdateRefusedError, WeightTransferError


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
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
    try:
        r = http.post(f"{url.rstrip('/')}/update_weights", json={"update_info": update_info},
                      headers=headers, timeout=timeout_s)
    except Exception as e:
        raise WeightTransferError(f"{url}/update_weights: {e}") from e
    return answer(r, refused=UpdateRefusedError)
