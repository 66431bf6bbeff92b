"""Running the app with uvicorn, with the shutdown a serving engine needs.

On SIGTERM or SIGINT the server keeps listening while it drains (`Service.drain`): new requests
get 503 and /health says "shutting down", running requests finish for up to the app's
shutdown_timeout, the rest are cancelled, and the open responses send their last events. Then
uvicorn stops as usual and the process exits with status 0. A second signal stops at once.

uvicorn's own handling would stop listening at the first signal and raise the signal again once
it has stopped (so that the process ends by it, not with status 0); this server replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from jaxmtp.serve.app import FLUSH_SECONDS

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one), made before anything slow starts,
    so that a port in use is reported at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class Server(uvicorn.Server):
    """uvicorn's server whose signals drain the app (see the module's docstring)."""

    def __init__(self, config: uvicorn.Config, *, drain, on_ready: Callable[[], None] | None = None):
        super().__init__(config)
        self._drain, self._on_ready = drain, on_ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._draining: asyncio.Task | None = None  # kept, so that the task is not collected

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._signalled) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _signalled(self, sig, frame):
        self._signals += 1
        if self._loop is None or self._signals > 1:  # before serving, or a second signal: stop now
            self.should_exit = True
            self.force_exit = self._signals > 1
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self):
        self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self):
        try:
            await self._drain()
        finally:
            self.should_exit = True

    async def startup(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and self._on_ready is not None:
            self._on_ready()


def serve(app: FastAPI, sock: socket.socket, *, quiet: bool = False, on_ready: Callable[[], None] | None = None):
    """Serves `app` (from jaxmtp.serve.create_app) on the listening socket `sock` (`bind`) until a
    signal has drained it; the engine is shut down however the server stops. on_ready: called once
    requests are taken."""
    service = app.state.service
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level="warning" if quiet else "info", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=int(FLUSH_SECONDS))
    server = Server(config, drain=service.drain, on_ready=on_ready)
    try:
        server.run(sockets=[sock])
    finally:
        service.stop_engine()
