"""The engine service: one EngineCore behind gRPC (``tandem engine``).

Threads: the core's busy loop (``EngineCoreLoop``) loads the model and steps on its
own thread, handing each step's ``EngineCoreOutputs`` to the asyncio event loop; there
the servicer (``servicer.py``) sends every client its share and then feeds the metrics,
the stats log and the request spans (all off the step loop). This module wires the
process: servers (``tandem.v1.EngineCore`` and ``vllm.grpc.engine.VllmEngine`` on one
port, ``tandem.v1.KvTransfer`` on a KV producer), health, start-up and warm-up, and the
CLI; the life after start-up (signals, the drain, a hung loop) is ``lifecycle.py``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field

from grpc_health.v1 import health, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.core_loop import EngineCoreLoop
from engine_service.cpu import keep_freed_memory_mapped
from engine_service.kv_transfer.grpc_connector import GrpcKvConnector
from engine_service.kv_transfer.service import SERVICE_NAME as KV_SERVICE_NAME
from engine_service.kv_transfer.service import KvTransferServicer
from engine_service.lifecycle import (
    LifecycleConfig,
    add_lifecycle_cli,
    lifecycle_config_from_args,
    run_until_stopped,
)
from engine_service.metrics import EngineMetrics, StatsLogger
from engine_service.servicer import MESSAGE_LIMITS, SERVICE_NAME, EngineServicer
from engine_service.vllm_grpc.kv_events import KvEventLog
from engine_service.vllm_grpc.servicer import SERVICE_NAME as VLLM_SERVICE_NAME
from engine_service.vllm_grpc.servicer import VllmEngineServicer
from tandem import telemetry
from tandem.grpc_guard import MalformedRequestGuard
from tandem.grpc_server import BindError, ServiceServer, add_health_port_cli
from tandem.health import ServiceHealth
from tandem.heap import freeze_startup_heap
from tandem.model_source import resolve_model
from tandem.protocol.outputs import (
    EngineCoreRequest,
)
from tandem.protocol.sampling_params import SamplingParams
from tandem.security import (
    EngineChannelSecurity,
    SecurityConfigError,
    ServerSecurity,
    TlsFiles,
    add_server_security_cli,
    server_security_from_args,
)
from tandem.signals import StopSignals
from tandem.telemetry import Tracing
from tandem.v1 import engine_pb2_grpc, kv_transfer_pb2_grpc

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass
class EngineServerConfig:
    """Network settings of the engine service (engine settings live in EngineConfig)."""

    host: str = "0.0.0.0"
    port: int = 50061
    engine_index: int = 0
    grace_seconds: float = 2.0  # time streams get to close on shutdown
    health_port: int = 0  # plain-text grpc.health.v1 alone on host:health_port; 0: off
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0: off
    log_stats_interval: float = 10.0  # seconds between stats log lines; 0: off
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, tokens, admin port
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)  # drain and step timeouts


def _warm_up(core: EngineCore) -> None:
    """A full-budget prefill and a decode through the whole step path before SERVING.

    The first step of a new size pays one-time costs (oneDNN primitives for its row
    count, first touches of activation memory), which the first request would
    otherwise wait for. The warm-up's prompt is dropped from the prefix cache afterwards.
    """
    n = max(1, min(core.config.max_num_batched_tokens, core.max_model_len - 2))
    prompt = [i % core.model_config.vocab_size for i in range(1, n + 1)]
    core.add_request(
        EngineCoreRequest("__warmup__", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    )
    while core.has_unfinished_requests():
        core.step()
    core.reset_prefix_cache()


async def serve_engine(
    engine_config: EngineConfig, server_config: EngineServerConfig, tracing: Tracing | None = None
) -> int:
    """Run until SIGTERM/SIGINT (exit 0) or until the core dies (exit 1).

    ``tracing``: where request, utility and start-up spans go (None: no spans).
    """
    metrics_server = None
    metrics = None
    kv_connector = _kv_connector(engine_config, server_config, tracing)
    if server_config.metrics_port:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        metrics = EngineMetrics(registry, server_config.engine_index)
        if kv_connector is not None:
            from engine_service.kv_transfer.observe import KvTransferCollector

            registry.register(KvTransferCollector(kv_connector, server_config.engine_index))
        metrics_server = telemetry.start_metrics_server(
            registry, server_config.host, server_config.metrics_port
        )
    stats_logger = (
        StatsLogger(server_config.engine_index, server_config.log_stats_interval)
        if server_config.log_stats_interval > 0
        else None
    )
    try:
        return await _serve_engine(engine_config, server_config, tracing, metrics, stats_logger, kv_connector)
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()


async def _serve_engine(
    engine_config: EngineConfig,
    server_config: EngineServerConfig,
    tracing: Tracing | None,
    metrics: EngineMetrics | None,
    stats_logger: StatsLogger | None,
    kv_connector: GrpcKvConnector | None = None,
) -> int:
    health_servicer = health.aio.HealthServicer()
    server = ServiceServer(
        server_config.host, server_config.port, server_config.security, MESSAGE_LIMITS,
        interceptors=[MalformedRequestGuard()],
        health_port=server_config.health_port,
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.port
    services = [SERVICE_NAME, VLLM_SERVICE_NAME]
    if kv_connector is not None and kv_connector.produces:
        if not kv_connector.address:
            kv_connector.address = _advertised_address(server_config.host, bound)
        kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(KvTransferServicer(lambda: kv_connector), server)
        services.append(KV_SERVICE_NAME)
        logger.info("engine %d serves its KV to consumers at %s", server_config.engine_index, kv_connector.address)
    server.enable_reflection(services)
    sec = server_config.security
    if not (sec.engine_token or sec.tls.ca) and server_config.host not in LOOPBACK_HOSTS:
        logger.warning(
            "engine %d accepts any client on Stream: set --engine-token or --tls-ca to admit only frontends",
            server_config.engine_index,
        )
    servicer = EngineServicer(engine_config.tokenizer or engine_config.model, tracing, metrics, stats_logger)
    engine_pb2_grpc.add_EngineCoreServicer_to_server(servicer, server)
    kv_events = KvEventLog(engine_config.block_size) if engine_config.enable_prefix_caching else None
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(servicer, kv_events), server)
    service_health = ServiceHealth(health_servicer, SERVICE_NAME, VLLM_SERVICE_NAME)
    await service_health.loading()
    await server.start()  # health answers NOT_SERVING while the model loads
    logger.info("engine %d listening on %s:%d", server_config.engine_index, server_config.host, bound)

    tracer = tracing.tracer if tracing is not None else None
    startup = (
        tracer.start_as_current_span(
            "engine_startup",
            attributes={"tandem.engine_index": server_config.engine_index, "tandem.model": engine_config.model},
        )
        if tracer is not None
        else contextlib.nullcontext()
    )

    def build_core() -> EngineCore:  # on the loop thread: see core_loop's docstring
        core = EngineCore(engine_config, server_config.engine_index, tracer, kv_connector=kv_connector)
        with tracer.start_as_current_span("warm_up") if tracer is not None else contextlib.nullcontext():
            _warm_up(core)
        core.kv_manager.set_event_sink(kv_events)  # after the warm-up: its blocks are no news
        return core

    with startup:  # model load, KV-cache allocation and warm-up as child spans
        engine_loop = EngineCoreLoop(build_core)  # copies the context: spans nest here
        engine_loop.start()
        core = await asyncio.wrap_future(engine_loop.started)
    servicer.attach(core, engine_loop)
    servicer.start_pump(asyncio.get_running_loop())
    signals = StopSignals().install()
    freeze_startup_heap()
    await service_health.ready()
    logger.info("engine %d SERVING %s", server_config.engine_index, engine_config.model)

    status = await run_until_stopped(
        servicer, service_health, engine_loop, server_config.engine_index, server_config.lifecycle, signals
    )
    await health_servicer.enter_graceful_shutdown()
    await server.stop(server_config.grace_seconds)
    if status == 0:  # a dead or hung loop thread is never joined
        engine_loop.shutdown()
    return status


def _kv_connector(
    engine_config: EngineConfig, server_config: EngineServerConfig, tracing: Tracing | None
) -> GrpcKvConnector | None:
    """The engine's KV connector (--kv-role), None without one. It reaches producers
    with this engine's own credentials: its --engine-token, and with --tls-ca its
    certificate as the client certificate and that CA as the trust root (an engine
    fleet shares them)."""
    if engine_config.kv_role is None:
        return None
    sec = server_config.security
    connector = GrpcKvConnector(
        engine_config.kv_role,
        engine_config.resolved_kv_engine_id(server_config.engine_index),
        engine_config.kv_address or "",
        engine_config.block_size,
        engine_config.kv_transfer_timeout_s,
        EngineChannelSecurity(
            tls=TlsFiles(sec.tls.cert, sec.tls.key, sec.tls.ca, flag_prefix="--tls"), engine_token=sec.engine_token
        ),
    )
    connector.tracing = tracing
    return connector


def _advertised_address(host: str, port: int) -> str:
    """host:port other engines reach this one at: a wildcard host means this host's name."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="Run one engine service (gRPC).",
                       description="Run one engine (scheduler, KV cache, model) as a gRPC service.")
    p.add_argument("--host", default=os.environ.get("TANDEM_ENGINE_HOST", "0.0.0.0"),
                   help="Listen address (env TANDEM_ENGINE_HOST).")
    p.add_argument("--port", type=int, default=int(os.environ.get("TANDEM_ENGINE_PORT", "50061")),
                   help="gRPC port (env TANDEM_ENGINE_PORT).")
    p.add_argument("--engine-index", type=int, default=int(os.environ.get("TANDEM_ENGINE_INDEX", "0")),
                   help="This engine's index among a frontend's engines (env TANDEM_ENGINE_INDEX).")
    telemetry.add_metrics_cli(p, default_port=8001)
    p.add_argument(
        "--log-stats-interval", type=float,
        default=float(os.environ.get("TANDEM_LOG_STATS_INTERVAL", "10")),
        help="Seconds between engine stats log lines (throughput, queue, KV usage); 0: off.",
    )
    add_health_port_cli(p)
    add_server_security_cli(p, engine=True)
    add_lifecycle_cli(p)
    EngineConfig.add_cli_args(p)
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    keep_freed_memory_mapped()  # before any thread exists: see its docstring
    args.model = resolve_model(args.model)
    args.tokenizer = resolve_model(args.tokenizer) if args.tokenizer else ""
    engine_config = EngineConfig.from_cli_args(args)
    server_config = EngineServerConfig(
        host=args.host,
        port=args.port,
        engine_index=args.engine_index,
        metrics_port=args.metrics_port,
        log_stats_interval=args.log_stats_interval,
        health_port=args.health_port,
        security=server_security_from_args(args, engine=True),
        lifecycle=lifecycle_config_from_args(args),
    )
    tracing = telemetry.tracing_from_env("tandem-engine")
    try:
        return asyncio.run(serve_engine(engine_config, server_config, tracing))
    except (BindError, SecurityConfigError) as exc:
        logger.error("tandem engine: %s", exc)
        return 1
    finally:
        if tracing is not None:
            tracing.shutdown()
