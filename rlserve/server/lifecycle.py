"""How the server runs: the listening socket, the engine process, one or more API server
processes, and uvicorn with rlserve's rules for stopping.

    rlserve serve ...                      -> serve(): this process is API server 0
    rlserve serve --api-server-count N     -> also N-1 processes `python -m
                                              rlserve.server.lifecycle`, on the same socket

Every API server talks to the one engine process (messages.py); the kernel spreads the
connections over them. Each request, with its detokenization and response, stays on the
API server that accepted it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import msgpack
import uvicorn

from rlserve.config import EngineConfig
from rlserve.process import spawn
from rlserve.server.options import ServeOptions

if TYPE_CHECKING:
    from fastapi import FastAPI

    from rlserve.frontend.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything slow happens (raises OSError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(config: EngineConfig, opts: ServeOptions) -> int:
    """Run the server until it is stopped; returns the process's exit code."""
    from rlserve.frontend.async_engine import AsyncEngine
    try:  # a port in use fails now, not after the model has loaded
        sock = bind_socket(opts.host, opts.port)
    except OSError as e:
        raise SystemExit(f"rlserve serve: cannot listen on {opts.host}:{opts.port}: {e.strerror} "
                         "(is another server there? choose --port)") from None
    logger.info("loading %s (device %s, dtype %s, load format %s, tensor parallel %d, "
                "data parallel %d)", config.model, config.device, config.dtype, config.load_format,
                config.tensor_parallel_size, config.data_parallel_size)
    # The engine process loads the model meanwhile.
    engine = AsyncEngine(config, num_clients=opts.api_server_count, log_level=opts.log_level)
    children = [_spawn_api_server(i, config, opts, engine, sock) for i in range(1, opts.api_server_count)]
    if children:
        logger.info("started %d more API server processes (pids %s)", len(children),
                    ", ".join(str(c.pid) for c in children))
    try:
        return _run(engine, config, opts, sock, children)
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=opts.shutdown_grace_period + 15)
            except subprocess.TimeoutExpired:
                child.kill()


def _run(engine: AsyncEngine, config: EngineConfig, opts: ServeOptions, sock: socket.socket,
         children: list[subprocess.Popen] | None = None) -> int:
    from rlserve.server.app import create_app
    shown_host = "localhost" if opts.host in ("0.0.0.0", "::", "") else opts.host
    url = f"http://{shown_host}:{opts.port}" if engine.client.client_index == 0 else None
    app = create_app(engine, config, opts, url=url)
    server = Server(app, engine, log_level=opts.uvicorn_log_level or opts.log_level,
                    grace_s=opts.shutdown_grace_period, linger_s=opts.engine_death_linger,
                    access_log=not opts.disable_uvicorn_access_log)
    if children:
        threading.Thread(target=_watch_api_servers, args=(children, server), name="rlserve-api-watch",
                         daemon=True).start()
    server.run(sockets=[sock])
    if engine.dead is not None or server.api_server_died:
        return 1
    return 0 if server.started else 1


def _watch_api_servers(children: list[subprocess.Popen], server: Server) -> None:
    """An API server that dies takes its share of the connections with it while /health,
    answered by another, stays 200: the whole server stops instead (exit status 1), so a
    supervisor restarts it and a load balancer stops sending it requests."""
    while not server.should_exit:
        for i, child in enumerate(children, start=1):
            status = child.poll()
            if status is not None and not server.should_exit:
                logger.error("API server %d (pid %d) exited with status %s: the server stops", i, child.pid, status)
                server.api_server_died = True
                os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's own handler: a graceful stop
                return
        time.sleep(_WATCH_INTERVAL_S)  # a child's exit has no event to wait on here


_WATCH_INTERVAL_S = 0.5


def _spawn_api_server(index: int, config: EngineConfig, opts: ServeOptions, engine: AsyncEngine,
                      sock: socket.socket) -> subprocess.Popen:
    from rlserve.frontend.core_client import EngineCoreClient
    sock.set_inheritable(True)
    client = engine.client
    assert isinstance(client, EngineCoreClient)  # one engine: the CLI refuses more API servers with data parallel
    addresses = client.addresses
    return spawn("rlserve.server.lifecycle", "--fd", str(sock.fileno()), "--index", str(index),
                 pass_fds=(sock.fileno(),), stdin=msgpack.packb({
                     "config": config.to_wire(), "options": dataclasses.asdict(opts),
                     "engine": {"input": addresses.input, "outputs": addresses.outputs}}, use_bin_type=True))


def api_server_main(argv: list[str] | None = None) -> int:
    """A further API server: attach to the running engine, serve on the inherited socket."""
    from rlserve.frontend.async_engine import AsyncEngine
    from rlserve.frontend.core_client import EngineAddresses
    parser = argparse.ArgumentParser(description="one more rlserve API server process")
    parser.add_argument("--fd", type=int, required=True, help="the listening socket")
    parser.add_argument("--index", type=int, required=True, help="this API server's number")
    args = parser.parse_args(argv)
    data = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
    opts = ServeOptions(**data["options"])
    logging.basicConfig(level=getattr(logging, opts.log_level.upper()),
                        format=f"%(asctime)s %(levelname)s [api {args.index}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    config = EngineConfig(**data["config"])
    engine = AsyncEngine(config, client_index=args.index, num_clients=opts.api_server_count,
                         addresses=EngineAddresses(data["engine"]["input"], data["engine"]["outputs"]),
                         log_level=opts.log_level)
    return _run(engine, config, opts, socket.socket(fileno=args.fd))


class Server(uvicorn.Server):
    """uvicorn, stopping as a rollout server should. On SIGINT or SIGTERM: stop accepting,
    let the requests in flight run for `grace_s`, then abort them (their responses end with
    finish_reason 'abort'), stop the engine, exit 0. If the engine dies: requests in flight
    end with an error at once, /health answers 503 for `linger_s`, then the process exits 1."""

    def __init__(self, app: FastAPI, engine: AsyncEngine, *, log_level: str, grace_s: float, linger_s: float,
                 access_log: bool = True):
        # uvicorn's annotation says int; it waits with asyncio.timeout, which takes a float.
        super().__init__(uvicorn.Config(app, log_level=log_level, timeout_keep_alive=30, access_log=access_log,
                                        timeout_graceful_shutdown=grace_s + 10))  # type: ignore[arg-type]
        self.app = app
        self.engine = engine
        self.grace_s = grace_s
        self.linger_s = linger_s
        self._stopping = False
        self.api_server_died = False  # another API server process exited: this one stops too
        engine.on_dead = self._engine_died

    def handle_exit(self, sig: int, frame) -> None:
        # Not uvicorn's own: it re-raises the signal after a graceful shutdown, which would
        # end the process with the signal's status instead of 0.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if not self._stopping and self.started:
            self._stopping = True
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(self.app.state.stopping.set)
            loop.call_soon_threadsafe(loop.call_later, self.grace_s, self._abort_in_flight)

    def _abort_in_flight(self) -> None:
        async def abort() -> None:
            try:
                n = await self.engine.abort_all()
            except Exception:
                return  # the engine is gone: its requests have failed already
            if n:
                logger.info("shutting down: aborted %d requests still in flight", n)

        asyncio.ensure_future(abort())

    def _engine_died(self, reason: str) -> None:
        asyncio.get_event_loop().call_later(self.linger_s, setattr, self, "should_exit", True)


if __name__ == "__main__":
    sys.exit(api_server_main())
