"""The frontend service (``tandem frontend``): the public ``tandem.v1.Generation`` API.

The servicer is thin: protobuf in, ``AsyncLLM`` call, protobuf out; every failure
goes through ``errors.abort_with`` for its status code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from frontend_service import admin, api
from frontend_service.admission import DEFAULT_MAX_PENDING_REQUESTS, PendingLimit
from frontend_service.async_llm import AsyncLLM, PauseMode
from frontend_service.discovery import InvalidTargetError, parse_target
from frontend_service.engine_client import (
    EngineConnection,
    EngineUnavailableError,
    TokenizerMismatchError,
)
from frontend_service.engine_group import DEFAULT_DISCOVERY_INTERVAL, EngineGroup
from frontend_service.errors import abort_with
from frontend_service.input_processor import InputProcessor
from frontend_service.metrics import FrontendMetrics
from frontend_service.migration import (
    MigrationConfig,
    add_migration_cli,
    migration_config_from_args,
)
from frontend_service.openai import add_http_port_cli
from frontend_service.placement import PlacementConfig, PlacementPolicy
from tandem import telemetry
from tandem.grpc_guard import MalformedRequestGuard
from tandem.grpc_server import BindError, MessageLimits, ServiceServer, add_health_port_cli
from tandem.health import ServiceHealth
from tandem.protocol import convert
from tandem.protocol.fingerprint import tokenizer_fingerprint
from tandem.protocol.model_config import ModelConfig
from tandem.protocol.sampling_params import RequestOutputKind, SamplingParams
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

SERVICE_NAME = frontend_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
TRACE_METADATA_KEYS = ("traceparent", "tracestate")
# A request is a prompt (or chat) and its sampling settings; prompt length is bounded by
# max_model_len long before this. Responses may carry prompt logprobs: larger.
MESSAGE_LIMITS = MessageLimits(max_receive_bytes=16 * 1024 * 1024, max_send_bytes=64 * 1024 * 1024)


@dataclass
class FrontendConfig:
    """Settings of one frontend service; each is a flag and a TANDEM_* env var."""

    model: str = ""  # checkpoint directory whose tokenizer files the frontend loads
    # engine targets: HOST:PORT, dns:///NAME:PORT or file:///PATH (see discovery.py)
    engines: list[str] = field(default_factory=list)
    host: str = "0.0.0.0"
    port: int = 50051
    client_index: int = 0  # tells engines which frontend a request came from
    connect_timeout: float = 60.0  # seconds to wait for every engine at start-up
    health_port: int = 0  # plain-text grpc.health.v1 alone on host:health_port; 0: off
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0: off
    http_port: int = 0  # the OpenAI-compatible HTTP API on host:http_port; 0: off (the CLI's default: 8080)
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


class GenerationServicer(frontend_pb2_grpc.GenerationServicer):
    """Registered before the engines answer; see ``attach``."""

    def __init__(self, fingerprint: str) -> None:
        self.llm: AsyncLLM = None  # type: ignore[assignment]  # set by attach()
        self.model_name = ""
        self.info: Any = None
        self.fingerprint = fingerprint
        self.draining = False  # set on SIGTERM/SIGINT: new Generate calls are refused

    def attach(self, llm: AsyncLLM, model_name: str, info: Any) -> None:
        self.llm = llm
        self.model_name = model_name
        self.info = info

    async def _require_ready(self, context: grpc.aio.ServicerContext) -> None:
        if self.llm is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the frontend is still connecting to its engines")

    async def _refuse_while_draining(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the frontend is draining")

    async def Generate(
        self, request: frontend_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        await self._require_ready(context)
        await self._refuse_while_draining(context)
        try:
            args = api.generate_args_from_proto(request)
            metadata = dict(context.invocation_metadata() or ())
            trace = {k: metadata[k] for k in TRACE_METADATA_KEYS if k in metadata}
            first = True
            stream = self.llm.generate(
                args.sampling_params,
                trace_headers=trace or None,
                timeout_s=context.time_remaining(),  # None without a client deadline
                **args.kwargs,
            )
            async for out in stream:
                yield api.response_to_proto(out, args.sampling_params, first)
                first = False
                if out.finished and any(c.finish_reason == "error" for c in out.outputs):
                    await context.abort(grpc.StatusCode.INTERNAL, "the engine failed this request")
        except asyncio.CancelledError:
            raise  # client cancelled or deadline passed: AsyncLLM already aborted
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    async def GenerateSession(
        self, request_iterator: AsyncIterator[frontend_pb2.GenerateSessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[frontend_pb2.GenerateSessionResponse]:
        await self._require_ready(context)
        await self._refuse_while_draining(context)
        inputs = request_iterator.__aiter__()
        try:
            first_msg = await anext(inputs, None)
            if first_msg is None:
                return
            turn = {"params": SamplingParams(output_kind=RequestOutputKind.DELTA), "first": True, "index": -1}

            async def chunks() -> AsyncIterator[Any]:
                msg = first_msg
                while msg is not None:
                    chunk = api.session_chunk_from_proto(msg)
                    turn["params"] = chunk.sampling_params or turn["params"]
                    turn["first"] = True
                    turn["index"] += 1
                    yield chunk
                    msg = await anext(inputs, None)

            outputs = self.llm.generate_session(
                chunks(),
                request_id=first_msg.request_id if first_msg.HasField("request_id") else None,
                timeout_s=context.time_remaining(),
            )
            async for out in outputs:
                response = api.response_to_proto(out, turn["params"], turn["first"])
                yield frontend_pb2.GenerateSessionResponse(response=response, turn=turn["index"])
                turn["first"] = False
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    async def Embed(
        self, request: frontend_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.EmbedResponse:
        await self._require_ready(context)
        await self._refuse_while_draining(context)
        try:
            inputs = api.embed_inputs_from_proto(request)
            params = convert.pooling_params_from_proto(request.pooling_params)
            params.validate()
            request_id = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
            timeout = context.time_remaining()

            async def one(index: int, kwargs: dict) -> frontend_pb2.Embedding:
                async for out in self.llm.encode(
                    params, request_id=f"{request_id}-{index}", priority=request.priority,
                    timeout_s=timeout, **kwargs,
                ):
                    return frontend_pb2.Embedding(
                        index=index, embedding=out.outputs.data, num_prompt_tokens=len(out.prompt_token_ids)
                    )
                raise RuntimeError("the pooling request ended without an output")

            data = await asyncio.gather(*(one(i, kw) for i, kw in enumerate(inputs)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await abort_with(context, exc)
        return frontend_pb2.EmbedResponse(
            request_id=request_id, data=data, num_prompt_tokens=sum(d.num_prompt_tokens for d in data)
        )

    async def Abort(
        self, request: frontend_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.AbortResponse:
        await self._require_ready(context)
        self.llm.abort(list(request.request_ids))
        return frontend_pb2.AbortResponse()

    async def Tokenize(
        self, request: frontend_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.TokenizeResponse:
        await self._require_ready(context)
        tok = self.llm.tokenizer
        chat = request.WhichOneof("input") == "chat"
        try:
            _, ids = self.llm.input_processor.encode(
                prompt=None if chat else request.prompt,
                messages=[{"role": m.role, "content": m.content} for m in request.chat.messages] if chat else None,
                add_special_tokens=(
                    request.add_special_tokens if request.HasField("add_special_tokens") else None
                ),
                add_generation_prompt=(
                    request.add_generation_prompt if request.HasField("add_generation_prompt") else None
                ),
            )
        except Exception as exc:
            await abort_with(context, exc)
        strings = tok.convert_ids_to_tokens(ids) if request.return_token_strings else []
        return frontend_pb2.TokenizeResponse(
            token_ids=ids, token_strings=strings, max_model_len=self.info.max_model_len
        )

    async def Detokenize(
        self, request: frontend_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.DetokenizeResponse:
        await self._require_ready(context)
        vocab = self.info.vocab_size
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"invalid token_ids: {bad[0]} is outside the vocabulary [0, {vocab})",
            )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = self.llm.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        return frontend_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(
        self, request: frontend_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.GetModelInfoResponse:
        await self._require_ready(context)
        eos = self.llm.input_processor.eos_token_id
        return frontend_pb2.GetModelInfoResponse(
            model=self.model_name,
            architecture=self.info.architecture,
            max_model_len=self.info.max_model_len,
            vocab_size=self.info.vocab_size,
            max_logprobs=self.info.max_logprobs,
            eos_token_id=eos,
            tokenizer_fingerprint=self.fingerprint,
            num_engines=len(self.llm.engines.engines),
        )

    async def PauseGeneration(
        self, request: frontend_pb2.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.PauseGenerationResponse:
        await self._require_ready(context)
        mode = PauseMode.WAIT if request.mode == frontend_pb2.PAUSE_MODE_WAIT else PauseMode.ABORT
        await self.llm.pause(mode)
        return frontend_pb2.PauseGenerationResponse()

    async def ResumeGeneration(
        self, request: frontend_pb2.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.ResumeGenerationResponse:
        await self._require_ready(context)
        self.llm.resume()
        return frontend_pb2.ResumeGenerationResponse()

    async def IsPaused(
        self, request: frontend_pb2.IsPausedRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.IsPausedResponse:
        await self._require_ready(context)
        return frontend_pb2.IsPausedResponse(paused=self.llm.paused)


async def serve_frontend(
    config: FrontendConfig, ready: asyncio.Event | None = None, tracing: Tracing | None = None
) -> int:
    """Run until SIGTERM/SIGINT. ``tracing``: where request spans go (None: no spans)."""
    if not config.engines:
        raise ValueError("the frontend needs at least one --engine HOST:PORT, dns:///NAME:PORT or file:///PATH")
    metrics_server = None
    metrics = None
    registry = None
    # One registry: served on --metrics-port and at the HTTP API's /metrics.
    if config.metrics_port or config.http_port:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        metrics = FrontendMetrics(registry)
    if config.metrics_port:
        metrics_server = telemetry.start_metrics_server(registry, config.host, config.metrics_port)
    try:
        return await _serve_frontend(config, ready, tracing, metrics, registry)
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()


async def _serve_frontend(
    config: FrontendConfig,
    ready: asyncio.Event | None,
    tracing: Tracing | None,
    metrics: FrontendMetrics | None,
    registry: Any = None,
) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model)
    fingerprint = tokenizer_fingerprint(config.model)
    health_servicer = health.aio.HealthServicer()
    server = ServiceServer(
        config.host, config.port, config.security, MESSAGE_LIMITS, interceptors=[MalformedRequestGuard()],
        health_port=config.health_port
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
    )
    admin_servicer = admin.FrontendAdminServicer(group)
    frontend_pb2_grpc.add_FrontendAdminServicer_to_server(admin_servicer, server)
    http = None
    if config.http_port:
        from frontend_service.openai.app import FrontendView
        from frontend_service.openai.server import HttpServer

        def http_ready() -> bool:  # readiness as grpc.health.v1 reports it
            return "llm" in holder and not servicer.draining and group.any_alive

        view = FrontendView(servicer, config.model, http_ready, registry)
        try:
            http = HttpServer(view, config.host, config.http_port, config.security.tls)
        except BaseException:
            await server.stop(0)
            raise
    await server.start()  # every servicer registered first: gRPC takes none once started
    if http is not None:
        http.start()  # answers 503 until the engines are connected
    try:
        info = await group.connect(fingerprint, config.connect_timeout)
    except BaseException:
        # Unreachable or mismatched engines: close the ports before giving up.
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
    )
    holder["llm"] = llm
    await llm.loras.refresh()  # the engines' --lora-modules, selectable by name
    admin_servicer.llm = llm
    servicer.attach(llm, model_name, info)
    admin_servicer.llm = llm
    signals = StopSignals().install()
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
    await group.close()
    return 0


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
                   help="Local checkpoint directory for the tokenizer (env TANDEM_MODEL); default: the demo model.")
    p.add_argument("--host", default=env("TANDEM_FRONTEND_HOST", "0.0.0.0"),
                   help="Listen address (env TANDEM_FRONTEND_HOST).")
    p.add_argument("--port", type=int, default=int(env("TANDEM_FRONTEND_PORT", "50051")),
                   help="gRPC port (env TANDEM_FRONTEND_PORT).")
    p.add_argument("--client-index", type=int, default=int(env("TANDEM_CLIENT_INDEX", "0")),
                   help="This frontend's index, told to engines (env TANDEM_CLIENT_INDEX).")
    p.add_argument("--connect-timeout", type=float, default=float(env("TANDEM_CONNECT_TIMEOUT", "60")),
                   help="Seconds to wait for every engine at start-up (env TANDEM_CONNECT_TIMEOUT).")
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
    add_health_port_cli(p)
    add_server_security_cli(p, engine=False)
    add_engine_channel_cli(p)
    add_migration_cli(p)
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
    model = args.model
    if not model:
        try:
            from engine_service.make_model import demo_model_dir
        except ImportError as exc:  # a frontend-only install: no torch to make the demo model
            raise SystemExit(f"tandem frontend: --model DIR is required ({exc})") from None
        model = demo_model_dir()
    return FrontendConfig(
        model=model,
        engines=engines,
        host=args.host,
        port=args.port,
        client_index=args.client_index,
        connect_timeout=args.connect_timeout,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        health_port=args.health_port,
        security=server_security_from_args(args, engine=False),
        engine_channel=engine_channel_from_args(args),
        max_pending_requests=args.max_pending_requests,
        drain_timeout=args.drain_timeout,
        discovery_interval=args.discovery_interval,
        placement=PlacementConfig(policy=PlacementPolicy(args.placement)),
        migration=migration_config_from_args(args),
    )


def run_cli(args: argparse.Namespace) -> int:
    tracing = telemetry.tracing_from_env("tandem-frontend")
    try:
        return asyncio.run(serve_frontend(config_from_args(args), tracing=tracing))
    except (EngineUnavailableError, TokenizerMismatchError, InvalidTargetError, BindError, SecurityConfigError) as exc:
        logger.error("cannot start the frontend: %s", exc)
        return 1
    finally:
        if tracing is not None:
            tracing.shutdown()
