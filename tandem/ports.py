"""Check, before starting anything, that the ports a command will listen on are free."""

from __future__ import annotations

import errno
import socket

from tandem.errors import PortInUseError


def ensure_free(host: str, port: int, role: str) -> None:
    """Raise PortInUseError naming ``role`` and ``host:port`` if another process listens there.

    The probe binds without SO_REUSEPORT (gRPC servers set it, so a second server would
    share the port silently) but with SO_REUSEADDR, so a port left in TIME_WAIT by a
    process that just exited counts as free while a listener does not."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortInUseError(f"cannot resolve {role} host {host!r}: {exc}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUseError(
                        f"port {port} ({role}, {host}:{port}) is already in use by another process"
                    ) from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue  # e.g. an IPv6 address on a host without IPv6
                raise PortInUseError(f"cannot bind {role} {host}:{port}: {exc.strerror}") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
