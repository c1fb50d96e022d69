"""How both services build their gRPC servers: options, ports, credentials, reflection.

``ServiceServer`` is the public server (plain text or TLS, guarded by
``security.AccessInterceptor``) plus, when an admin port is set, a plain-text twin bound
to 127.0.0.1 that serves the same servicers without the admin check, and, when a health
port is set, a plain-text server with grpc.health.v1 alone (Kubernetes' gRPC probes
cannot speak TLS; health tells nothing an attacker could use). It has the
``add_generic_rpc_handlers`` / ``add_registered_method_handlers`` pair of
``grpc.aio.Server``, so the generated ``add_*Servicer_to_server`` functions register a
servicer on both at once. Torch-free.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as reflection_v1alpha_pb2_grpc

from tandem.security import AccessInterceptor, ServerSecurity

logger = logging.getLogger(__name__)

ADMIN_HOST = "127.0.0.1"  # the admin listener is loopback-only, always
REFLECTION_V1_SERVICE = "grpc.reflection.v1.ServerReflection"


@dataclass(frozen=True)
class MessageLimits:
    """Largest gRPC message, in bytes, each direction; beyond it: RESOURCE_EXHAUSTED."""

    max_receive_bytes: int
    max_send_bytes: int


class BindError(OSError):
    """A listening address that cannot be bound (held by another process, or not local)."""

    def __init__(self, address: str, what: str = "port") -> None:
        super().__init__(
            f"cannot listen on {address} ({what}): the address is in use by another process "
            "or is not an address of this machine"
        )
        self.address = address


def server_options(limits: MessageLimits, reuse_port: bool = False) -> list[tuple[str, Any]]:
    """``reuse_port``: share the port with this user's other processes that ask for it
    too (SO_REUSEPORT; the kernel spreads connections across them): the frontend
    processes of one ``tandem serve --frontends N``."""
    return [
        ("grpc.max_receive_message_length", limits.max_receive_bytes),
        ("grpc.max_send_message_length", limits.max_send_bytes),
        # grpc's default SO_REUSEPORT lets a second server bind a port already in use and
        # take half its connections; a held port must fail the bind instead.
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        # Frontends ping engines every 10 s (engine_client.CHANNEL_OPTIONS); allow that, or
        # the server answers GOAWAY "too_many_pings" after ~30 s idle. (The C-core name of
        # this server option has no "recv" in it.)
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def _bind(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None, what: str
) -> int:
    try:
        port = (
            server.add_insecure_port(address)
            if credentials is None
            else server.add_secure_port(address, credentials)
        )
    except RuntimeError as exc:  # grpc >= 1.5x raises "Failed to bind to address ..."
        raise BindError(address, what) from exc
    if port == 0:
        raise BindError(address, what)
    return port


class ServiceServer:
    """The public server and the optional loopback admin server of one service."""

    def __init__(
        self,
        host: str,
        port: int,
        security: ServerSecurity,
        limits: MessageLimits,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        health_port: int = 0,
        reuse_port: bool = False,
    ) -> None:
        """Binds the ports now (a held port raises ``BindError`` before anything starts).
        ``health_port``: plain-text grpc.health.v1 on ``host:health_port``; 0: none.
        ``reuse_port``: the public port is shared (see ``server_options``)."""
        options = server_options(limits)
        self.public = grpc.aio.server(
            interceptors=[AccessInterceptor(security), *interceptors],
            options=server_options(limits, reuse_port),
        )
        address = f"{host}:{port}"
        self.port = _bind(self.public, address, security.tls.server_credentials(), "public port")
        self.address = f"{host}:{self.port}"
        self.admin: grpc.aio.Server | None = None
        self.admin_port = 0
        if security.admin_port:
            self.admin = grpc.aio.server(interceptors=list(interceptors), options=options)
            self.admin_port = _bind(self.admin, f"{ADMIN_HOST}:{security.admin_port}", None, "admin port")
        self.health: grpc.aio.Server | None = None
        if health_port:
            self.health = grpc.aio.server(options=options)
            _bind(self.health, f"{host}:{health_port}", None, "health port")

    @property
    def servers(self) -> list[grpc.aio.Server]:
        return [self.public] if self.admin is None else [self.public, self.admin]

    # The two methods the generated add_*Servicer_to_server functions call.
    def _targets(self, service_name: str | None) -> list[grpc.aio.Server]:
        if self.health is not None and service_name == health.SERVICE_NAME:
            return [*self.servers, self.health]
        return self.servers

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        handlers = tuple(handlers)
        for handler in handlers:
            name = handler.service_name() if hasattr(handler, "service_name") else None
            for server in self._targets(name):
                server.add_generic_rpc_handlers((handler,))

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        for server in self._targets(service_name):
            server.add_registered_method_handlers(service_name, method_handlers)

    def enable_reflection(self, service_names: Iterable[str]) -> None:
        """grpc.reflection v1 and v1alpha, listing ``service_names``, health and themselves."""
        add_reflection(self, service_names)

    async def start(self) -> None:
        for server in self.servers:
            await server.start()
        if self.health is not None:
            await self.health.start()
        if self.admin is not None:
            logger.info("admin listener on %s:%d", ADMIN_HOST, self.admin_port)

    async def stop(self, grace: float | None) -> None:
        for server in self.servers:
            await server.stop(grace)
        if self.health is not None:
            await self.health.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.public.wait_for_termination(timeout)


def add_health_port_cli(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--health-port", type=int, default=int(os.environ.get("TANDEM_HEALTH_PORT", "0")),
        help="Also serve grpc.health.v1 alone, in plain text, on this port (for probes that "
        "cannot speak TLS, e.g. Kubernetes' gRPC probes); 0: off (env TANDEM_HEALTH_PORT).",
    )


# ---- reflection v1 ---------------------------------------------------------------------
# grpcio-reflection 1.85 ships only grpc.reflection.v1alpha. v1 is the same protocol under
# another package name (same messages, same field numbers), so v1 calls are served by the
# v1alpha servicer, and the v1 file descriptor is the v1alpha one renamed, so that clients
# can also describe the v1 service itself.


def _ensure_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_v1alpha_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = name, "grpc.reflection.v1"
    fdp.ClearField("options")
    for message in fdp.message_type:
        for fld in message.field:
            if fld.type_name.startswith(old):
                fld.type_name = new + fld.type_name.removeprefix(old)
    for service in fdp.service:
        for method in service.method:
            method.input_type = new + method.input_type.removeprefix(old)
            method.output_type = new + method.output_type.removeprefix(old)
    pool.Add(fdp)


def add_reflection(server: ServiceServer | grpc.aio.Server, service_names: Iterable[str]) -> None:
    names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE)
    _ensure_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_methods = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_v1alpha_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1_SERVICE, v1_methods),)
    )
    server.add_registered_method_handlers(REFLECTION_V1_SERVICE, v1_methods)
