"""Where the engines are: ``--engine`` targets and the resolvers behind them.

A target is one of
- ``HOST:PORT`` (``[V6ADDR]:PORT`` for IPv6): one fixed engine;
- ``dns:///NAME:PORT``: every address ``NAME`` resolves to is an engine (a headless
  Kubernetes Service, a round-robin DNS name); resolved again every discovery interval;
- ``file:///PATH``: one ``HOST:PORT`` per line (blank lines and ``#`` comments are
  skipped); read again every discovery interval. Replace the file atomically (write a
  temporary file, then rename it) so a half-written list is never read.

``resolve()`` returns engine addresses as ``HOST:PORT`` strings, sorted and without
duplicates; it raises ``ResolveError`` when the target cannot be resolved right now, and
the caller then keeps the addresses it resolved last.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class InvalidTargetError(ValueError):
    """An engine target or address that cannot be parsed. Maps to INVALID_ARGUMENT."""


class ResolveError(RuntimeError):
    """A target that is well-formed but cannot be resolved right now."""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6ADDR]:PORT`` -> (host, port); raises InvalidTargetError."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise InvalidTargetError(f"invalid engine address {text!r}: expected [V6ADDR]:PORT")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidTargetError(f"invalid engine address {text!r}: {host!r} is no IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise InvalidTargetError(f"invalid engine address {text!r}: expected HOST:PORT")
        if ":" in host:
            raise InvalidTargetError(f"invalid engine address {text!r}: write IPv6 hosts as [V6ADDR]:PORT")
    if any(c.isspace() or c in "/?#@" for c in host):
        raise InvalidTargetError(f"invalid engine address {text!r}: bad host {host!r}")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidTargetError(f"invalid engine address {text!r}: the port must be 1..65535")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def normalize_address(text: str) -> str:
    """The canonical spelling of an engine address (raises InvalidTargetError)."""
    return format_address(*parse_address(text))


class Target(Protocol):
    """One ``--engine`` value."""

    @property
    def dynamic(self) -> bool:
        """True when the addresses can change and are resolved again periodically."""
        ...

    async def resolve(self) -> list[str]: ...


@dataclass(frozen=True)
class FixedTarget:
    address: str
    dynamic = False

    async def resolve(self) -> list[str]:
        return [self.address]

    def __str__(self) -> str:
        return self.address


@dataclass(frozen=True)
class DnsTarget:
    host: str
    port: int
    dynamic = True

    async def resolve(self) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:  # socket.gaierror: the name does not resolve (now)
            raise ResolveError(f"cannot resolve {self}: {exc}") from exc
        # sockaddr is (ip, port) for IPv4 and (ip, port, flow, scope) for IPv6.
        return sorted({format_address(str(sockaddr[0]), self.port) for *_, sockaddr in infos})

    def __str__(self) -> str:
        return f"dns:///{format_address(self.host, self.port)}"


@dataclass(frozen=True)
class FileTarget:
    path: Path
    dynamic = True

    async def resolve(self) -> list[str]:
        try:
            text = self.path.read_text()
        except OSError as exc:
            raise ResolveError(f"cannot read {self}: {exc}") from exc
        return parse_address_list(text, str(self))

    def __str__(self) -> str:
        return f"file://{self.path}"


def parse_address_list(text: str, source: str = "the list") -> list[str]:
    """Addresses of a target-list file: one per line; blanks and ``#`` comments skipped.

    A line that is no address raises ResolveError (the whole list is then ignored and
    the previous one kept, rather than dropping engines because of one typo).
    """
    addresses = set()
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            addresses.add(normalize_address(line))
        except InvalidTargetError as exc:
            raise ResolveError(f"{source} line {number}: {exc}") from None
    return sorted(addresses)


def parse_target(text: str) -> Target:
    """One ``--engine`` value -> its target (raises InvalidTargetError)."""
    text = text.strip()
    if text.startswith("dns:"):
        rest = text[len("dns:"):]
        if rest.startswith("//"):
            authority, _, rest = rest[2:].partition("/")
            if authority:
                raise InvalidTargetError(
                    f"invalid engine target {text!r}: a DNS server authority is not supported, "
                    "use dns:///NAME:PORT (the system resolver)"
                )
        return DnsTarget(*parse_address(rest))
    if text.startswith("file:"):
        rest = text[len("file:"):]
        if not rest.startswith("///"):
            raise InvalidTargetError(f"invalid engine target {text!r}: expected file:///ABSOLUTE/PATH")
        return FileTarget(Path(rest[2:]))
    if "://" in text:
        raise InvalidTargetError(
            f"invalid engine target {text!r}: expected HOST:PORT, dns:///NAME:PORT or file:///PATH"
        )
    return FixedTarget(normalize_address(text))
