"""Who may call the weight-update control plane.

Whoever reaches these endpoints can replace the model's weights, so they are closed by
default, in three checks made before any route runs (`require_control_access`):

- Browsers: a web page on any machine that can reach the server could otherwise post to
  it ("simple" cross-origin requests need no preflight). Any `Origin` that is not the
  server's own, and a POST body that is not declared JSON, is refused with a 403.
- Clients: with `--admin-key`, a request must carry it (401 otherwise). Without one, only
  loopback clients (127.0.0.0/8, ::1) are served, and the `Host` they ask for must be an
  IP address, `localhost` or this machine's name, so that a page whose own host name
  resolves to 127.0.0.1 (DNS rebinding) is not taken for a local client.
  `--allow-remote-control` opens them to every client instead, without a key.

The client's address is the one uvicorn reports: the peer's, or the `X-Forwarded-For`
a loopback peer (a reverse proxy on this machine) sends (`FORWARDED_ALLOW_IPS` widens whom
uvicorn believes). A local proxy that sends no such header makes every client look local:
behind one, set `--admin-key`.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import socket
from urllib.parse import urlsplit

from fastapi import Request

from rlserve.server.responses import APIError

_DEFAULT_PORTS = {"http": 80, "https": 443}


def describe_control_access(admin_key: str | None, allow_remote_control: bool) -> str:
    """For the start-up log: who can call the control endpoints."""
    if admin_key:
        return "need the admin key (Authorization: Bearer <admin-key>)"
    if allow_remote_control:
        return "are open to every client without a key (--allow-remote-control)"
    return ("answer loopback clients only (127.0.0.0/8, ::1); set --admin-key to open them "
            "to the network")


def _forbidden(message: str) -> APIError:
    return APIError(403, message, type="permission_error")


def _is_loopback(host: str | None) -> bool:
    try:
        ip = ipaddress.ip_address(host or "")
    except ValueError:  # no client address (a unix socket, a test transport): not loopback
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a dual-stack socket's view of 127.0.0.1
    return ip.is_loopback


@functools.cache
def _own_host_names() -> frozenset[str]:
    # Not getfqdn(): it asks DNS, which may hang where there is none, and this runs on the event loop.
    names = {"localhost", socket.gethostname().lower()}
    return frozenset(n for n in names if n)


def _host_and_port(netloc: str, scheme: str) -> tuple[str, int | None]:
    parts = urlsplit(f"{scheme}://{netloc}")
    try:
        port = parts.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:  # not a number: no port matches it
        port = -1
    return (parts.hostname or "").lower(), port


def _is_own_origin(origin: str, request: Request) -> bool:
    """`Origin` names the scheme, host and port the client sent this request to."""
    scheme = request.url.scheme
    parts = urlsplit(origin.strip())
    if parts.scheme.lower() != scheme or parts.path or parts.query or not parts.netloc:
        return False  # also "null" (sandboxed frames, file:// pages)
    host = request.headers.get("host")
    return host is not None and _host_and_port(parts.netloc, scheme) == _host_and_port(host, scheme)


def _is_local_host_name(host_header: str | None, scheme: str) -> bool:
    if host_header is None:  # HTTP/1.0 without Host: not a browser
        return True
    host, _ = _host_and_port(host_header, scheme)
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host in _own_host_names()


def _bearer_token(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def require_control_access(request: Request) -> None:
    """Dependency of every control route (see the module docstring)."""
    origin = request.headers.get("origin")
    if origin is not None and not _is_own_origin(origin, request):
        raise _forbidden(f"control endpoints refuse cross-origin requests (Origin: {origin[:100]!r} "
                         "is not this server's own)")
    if request.method == "POST":
        content_type = request.headers.get("content-type")
        media_type = (content_type or "").split(";")[0].strip().lower()
        if content_type is not None and media_type != "application/json":
            raise _forbidden(f"control endpoints take JSON: Content-Type {content_type[:100]!r} is "
                             "refused (send application/json, or no body)")
    state = request.app.state
    if state.admin_key:
        if not hmac.compare_digest(_bearer_token(request).encode(), state.admin_key.encode()):
            raise APIError(401, "control endpoints need the admin key: Authorization: Bearer <admin-key>",
                           type="authentication_error")
        return
    if state.allow_remote_control:
        return
    client = request.client.host if request.client else None
    if not _is_loopback(client):
        raise _forbidden(f"control endpoints answer loopback clients only, and {client} is not one: "
                         "start the server with --admin-key (or --allow-remote-control) to open "
                         "them to the network")
    if not _is_local_host_name(request.headers.get("host"), request.url.scheme):
        raise _forbidden(f"control endpoints answer loopback clients only: Host "
                         f"{request.headers.get('host', '')[:100]!r} is not this machine's address "
                         "or name (use 127.0.0.1 or localhost, or start the server with --admin-key)")
