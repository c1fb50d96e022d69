"""uvicorn serving the OpenAI-compatible app as a task of the frontend's own event loop.

No second loop, thread or process: handlers call the frontend's AsyncLLM directly. The
port is bound here (without SO_REUSEPORT, like the gRPC ports) so a busy port fails
start-up with ``BindError``; the frontend's TLS files (``--tls-cert/--tls-key``, and
``--tls-ca`` for client certificates) apply to HTTP too. uvicorn does not touch the
signal handlers: SIGTERM/SIGINT stay the frontend's (its drain), which then calls ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import uvicorn

from frontend_service.openai.app import FrontendView, build_app
from tandem.grpc_server import BindError
from tandem.security import TlsFiles

logger = logging.getLogger(__name__)

class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the frontend owns SIGTERM/SIGINT


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket on host:port (SO_REUSEADDR; SO_REUSEPORT too with
    ``reuse_port``, shared with the other frontend processes of one serve), or BindError."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError:
        raise BindError(f"{host}:{port}", "HTTP port") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise BindError(f"{host}:{port}", "HTTP port") from None
    sock.setblocking(False)
    return sock


class HttpServer:
    """``start`` binds and serves in the background; ``stop`` closes the port, lets open
    responses finish for up to ``grace`` seconds, then cancels them."""

    def __init__(
        self, view: FrontendView, host: str, port: int, tls: TlsFiles | None = None, reuse_port: bool = False
    ) -> None:
        self.sock = bind(host, port, reuse_port)
        self.port: int = self.sock.getsockname()[1]
        self.host = host
        kwargs = {}
        if tls is not None and tls.cert:
            kwargs = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.ca:
                kwargs.update(ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(
            build_app(view), loop="none", lifespan="off", log_level="warning", access_log=False,
            http="h11", ws="none", server_header=False, timeout_graceful_shutdown=5, **kwargs,
        )
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.server.config.is_ssl else "http"

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        logger.info("OpenAI-compatible API on %s://%s:%d/v1", self.scheme, self.host, self.port)

    async def stop(self, grace: float = 5.0) -> None:
        if self.task is None:
            self.sock.close()
            return
        self.server.config.timeout_graceful_shutdown = int(grace) or 1
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace + 5)
        except (TimeoutError, asyncio.CancelledError):
            self.server.force_exit = True
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        finally:
            self.sock.close()
