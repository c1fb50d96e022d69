"""Tracing and metrics plumbing shared by the engine and frontend services.

Tracing is configured only by the standard OpenTelemetry environment variables:
``tracing_from_env`` builds a ``TracerProvider`` (BatchSpanProcessor + OTLP/gRPC
exporter) when ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``
is set or ``OTEL_TRACES_EXPORTER`` names an exporter, and returns None otherwise, so a
service without tracing holds ``None`` and pays one ``is not None`` check per request.
Sampling (``OTEL_TRACES_SAMPLER[_ARG]``), ``OTEL_SDK_DISABLED``, the resource
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``), batching (``OTEL_BSP_*``) and the
exporter's endpoint, headers, timeout and TLS are read by the SDK itself.

Metrics: each service owns one ``prometheus_client.CollectorRegistry`` and serves it
on ``--metrics-port`` (``start_metrics_server``).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_SUPPORTED_EXPORTERS = ("otlp", "console")


@dataclass
class Tracing:
    """A service's tracer, its provider (to flush on exit) and the W3C propagator."""

    tracer: trace.Tracer
    provider: Any  # opentelemetry.sdk.trace.TracerProvider (or a test double)
    propagator: TextMapPropagator = field(default_factory=TraceContextTextMapPropagator)

    def extract(self, carrier: Mapping[str, str] | None) -> Context | None:
        """The remote parent in W3C ``traceparent``/``tracestate`` headers, if any."""
        if not carrier:
            return None
        return self.propagator.extract(carrier)

    def inject(self, span: trace.Span) -> dict[str, str]:
        """W3C headers that make ``span`` the parent on the other side of a hop."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def shutdown(self) -> None:
        """Export what is still batched, then stop the exporter."""
        try:
            self.provider.shutdown()
        except Exception:  # exporting at exit must never fail the service
            logger.exception("tracing shutdown failed")


def _exporters_from_env() -> list[str]:
    """The span exporters the environment asks for; [] means tracing is off."""
    value = os.environ.get("OTEL_TRACES_EXPORTER")
    if value is not None:
        names = [n.strip().lower() for n in value.split(",") if n.strip()]
        return [n for n in names if n != "none"]
    if any(os.environ.get(var) for var in _ENDPOINT_VARS):
        return ["otlp"]
    return []


def tracing_from_env(default_service_name: str) -> Tracing | None:
    """A Tracing when the OTel environment configures an exporter, else None.

    ``default_service_name`` is used only when neither ``OTEL_SERVICE_NAME`` nor
    ``OTEL_RESOURCE_ATTRIBUTES`` names the service.
    """
    exporters = _exporters_from_env()
    if not exporters:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = Resource.create({SERVICE_NAME: default_service_name})
    # No sampler argument: the SDK reads OTEL_TRACES_SAMPLER / _ARG (default
    # parentbased_always_on) and OTEL_SDK_DISABLED itself.
    provider = TracerProvider(resource=resource)
    tracer = provider.get_tracer("tandem")
    if isinstance(tracer, trace.NoOpTracer):  # OTEL_SDK_DISABLED=true
        return None
    for name in exporters:
        if name == "otlp":
            protocol = os.environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            )
            if protocol != "grpc":
                logger.warning("OTLP protocol %r is not supported; exporting spans over gRPC", protocol)
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            quiet_export_failures()
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            logger.warning(
                "OTEL_TRACES_EXPORTER=%s is not supported (one of %s); ignored",
                name, ", ".join(_SUPPORTED_EXPORTERS),
            )
    logger.info(
        "tracing on: service %s, exporters %s",
        resource.attributes.get(SERVICE_NAME), ", ".join(exporters),
    )
    return Tracing(tracer, provider)


OTLP_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"


class ThrottledLog(logging.Filter):
    """Lets a logger's warnings and errors through at most once per ``interval_s``; the
    first goes at once, a later one says how many were held back since. Debug and info
    records pass untouched.

    For the OTLP exporter, which logs every retry and every failed export: with its
    collector away (the compose stack without its observability profile, a collector
    restarting) each service would log a line every few seconds while requests flow."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            self._held += 1
            return False
        if self._held:
            record.msg = f"{record.getMessage()} ({self._held} more held back in the last {now - self._last:.0f} s)"
            record.args = None
        self._last, self._held = now, 0
        return True


def quiet_export_failures(interval_s: float = 60.0) -> None:
    """Throttle the OTLP exporter's retry and failure messages (``ThrottledLog``); once
    per process."""
    exporter_logger = logging.getLogger(OTLP_EXPORTER_LOGGER)
    if not any(isinstance(f, ThrottledLog) for f in exporter_logger.filters):
        exporter_logger.addFilter(ThrottledLog(interval_s))


# ---- metrics ------------------------------------------------------------------------------


def add_metrics_cli(parser: argparse.ArgumentParser, default_port: int) -> None:
    """``--metrics-port`` (env ``TANDEM_METRICS_PORT``); 0 disables the endpoint."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("TANDEM_METRICS_PORT", str(default_port))),
        help=f"Serve Prometheus metrics on this port at /metrics (default {default_port}; 0: off).",
    )


def start_metrics_server(registry: Any, host: str, port: int) -> Any | None:
    """Serve ``registry`` at http://host:port/metrics on a daemon thread.

    Returns the server (``.shutdown()`` stops it), or None when the port is taken: a
    metrics endpoint that cannot bind is logged and the service runs on without it.
    """
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        logger.error("cannot serve metrics on %s:%d (%s); running without /metrics", host, port, exc)
        return None
    logger.info("metrics on http://%s:%d/metrics", host, port)
    return server


def wall_ns(seconds: float) -> int:
    """Epoch seconds as the integer nanoseconds span start/end times take."""
    return int(seconds * 1e9)


# ---- OpenTelemetry GenAI semantic-convention attributes -----------------------------------

# Latency attributes (seconds), named as vLLM names them on its request spans.
LATENCY_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TTFT = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_DECODE = "gen_ai.latency.time_in_model_decode"
LATENCY_INFERENCE = "gen_ai.latency.time_in_model_inference"


def gen_ai_request_attributes(model: str, params: Any) -> dict[str, Any]:
    """``gen_ai.request.*`` of one request's SamplingParams."""
    attrs: dict[str, Any] = {
        "gen_ai.request.model": model,
        "gen_ai.request.temperature": float(params.temperature),
        "gen_ai.request.top_p": float(params.top_p),
    }
    if params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = int(params.max_tokens)
    if params.top_k is not None and params.top_k > 0:
        attrs["gen_ai.request.top_k"] = int(params.top_k)
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = int(params.seed)
    if params.n != 1:
        attrs["gen_ai.request.choice.count"] = int(params.n)
    if params.presence_penalty:
        attrs["gen_ai.request.presence_penalty"] = float(params.presence_penalty)
    if params.frequency_penalty:
        attrs["gen_ai.request.frequency_penalty"] = float(params.frequency_penalty)
    if params.stop:
        attrs["gen_ai.request.stop_sequences"] = list(params.stop)
    return attrs


def gen_ai_usage_attributes(
    input_tokens: int, output_tokens: int, cached_tokens: int, finish_reasons: list[str]
) -> dict[str, Any]:
    return {
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
        "gen_ai.usage.cache_read.input_tokens": cached_tokens,
        "gen_ai.response.finish_reasons": finish_reasons,
    }
