"""The master address of a transfer group: pick one, vet one, reach one, within a deadline."""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
import threading
import time
from urllib.parse import urlsplit

from rlserve import envs

from .errors import InvalidUpdateError, WeightTransferError

RESOLVE_TIMEOUT_S = 10.0  # a name server that never answers must not hold an init for long
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
# connect() errors that waiting will not cure: no route, or an address no host can have.
_NO_ROUTE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.EINVAL, errno.EAFNOSUPPORT}


def get_ip() -> str:
    """This host's outbound IP address (no packet is sent), else 127.0.0.1; $VLLM_HOST_IP
    when set, as vLLM's get_ip reads it. Kept for scripts written for vLLM: a trainer
    that knows its servers' URLs should rendezvous at `rendezvous_address(urls)`."""
    return envs.VLLM_HOST_IP.get() or local_ip_towards("8.8.8.8")


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def local_ip_towards(address: str) -> str:
    # Connecting a UDP socket only picks the route; it sends nothing.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 80))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def rendezvous_address(server_urls: str | list[str]) -> str:
    """Where a trainer should host its group for these servers: the local address on the
    route to them, so a group with servers on this host stays on loopback and a
    multi-homed host picks the interface that reaches the servers, not its default route.
    Servers on loopback and elsewhere at once: the route to the first one elsewhere."""
    urls = [server_urls] if isinstance(server_urls, str) else list(server_urls)
    hosts = [urlsplit(u if "//" in u else f"//{u}").hostname or "127.0.0.1" for u in urls]
    remote = [h for h in hosts if not is_loopback(h)]
    return local_ip_towards(remote[0]) if remote else "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address or a name) names this host's loopback interface."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost" or host.endswith(".localhost")


def address_problem(address: object) -> str | None:
    """Why `address` is not a host name or a unicast IP address, or None when it is one."""
    if not isinstance(address, str) or not address:
        return f"must be a non-empty string (a host name or an IP address), got {address!r}"
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        ip = None
    if ip is not None:
        if ip.is_unspecified or ip.is_multicast or (ip.is_reserved and not ip.is_loopback):
            return f"{address!r} is not a unicast address a trainer can listen on"
        return None
    name = address[:-1] if address.endswith(".") else address
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        return f"{address!r} is neither an IP address nor a valid host name"
    if re.fullmatch(r"[0-9.]+", name):
        return f"{address!r} is not a valid IP address"
    return None


def resolve(address: str, port: int, timeout_s: float) -> None:
    """Refuse (InvalidUpdateError) a name that does not resolve within the timeout."""
    box: dict = {}

    def lookup() -> None:
        try:
            box["ok"] = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
        except OSError as e:
            box["error"] = e

    t = threading.Thread(target=lookup, name="rlserve-resolve", daemon=True)
    t.start()
    t.join(min(timeout_s, RESOLVE_TIMEOUT_S))
    if "error" in box:
        raise InvalidUpdateError(f"init_info.master_address {address!r} does not resolve: {box['error']}")
    if "ok" not in box:
        raise InvalidUpdateError(f"init_info.master_address {address!r}: name resolution took longer "
                                 f"than {min(timeout_s, RESOLVE_TIMEOUT_S):g}s")


def wait_listening(address: str, port: int, deadline: float, cancelled: threading.Event | None = None) -> None:
    """Poll until something accepts connections at address:port (the trainer may start a
    little after us); an address with no route fails at once."""
    while True:
        try:
            with socket.create_connection((address, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            if e.errno in _NO_ROUTE:
                raise WeightTransferError(f"cannot reach {address}:{port}: {e}") from e
            if time.monotonic() >= deadline or (cancelled is not None and cancelled.is_set()):
                raise WeightTransferError(f"nothing accepts connections at {address}:{port} "
                                          f"(is the trainer's trainer_init running?): {e}") from e
            time.sleep(0.1)
