"""KV transfers in Prometheus (``tandem:kv_transfer_*``) and in traces.

The connector counts into a ``TransferStats``; ``KvTransferCollector`` reads it (and the
number of held transfers) from any ``TransferSource`` when scraped. The spans
(``kv_transfer_pull`` on the consumer, ``kv_transfer_send`` on the producer) hang under
the request's trace: the consumer has the request's trace headers and passes them on
to the producer as the pull's gRPC metadata.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.telemetry import Tracing, wall_ns

TRACE_KEYS = ("traceparent", "tracestate")


@dataclass
class TransferStats:
    """Counters since start (the Prometheus metrics read them)."""

    bytes_sent: int = 0  # producer: KV bytes streamed to consumers
    bytes_received: int = 0  # consumer: KV bytes pulled
    pulls_served: int = 0  # producer: pulls streamed to the end
    loads_ok: int = 0  # consumer: loads that filled their blocks
    loads_failed: int = 0  # consumer: loads that fell back to computing
    load_seconds: float = 0.0  # consumer: time from start_load to the data in hand
    expired: int = 0  # producer: transfers freed unpulled


class TransferSource(Protocol):
    """What the collector reads at each scrape (``GrpcKvConnector`` is one)."""

    @property
    def stats(self) -> TransferStats: ...

    @property
    def num_held_transfers(self) -> int: ...


class KvTransferCollector(Collector):
    def __init__(self, connector: TransferSource, engine_index: int) -> None:
        self.connector = connector
        self.engine = str(engine_index)

    def collect(self) -> Iterator[Any]:
        stats, engine = self.connector.stats, self.engine
        moved = CounterMetricFamily(
            "tandem:kv_transfer_bytes",
            "KV-cache bytes moved between engines, by direction.",
            labels=["engine", "direction"],
        )
        moved.add_metric([engine, "sent"], stats.bytes_sent)
        moved.add_metric([engine, "received"], stats.bytes_received)
        yield moved
        seconds = CounterMetricFamily(
            "tandem:kv_transfer_seconds",
            "Consumer: time from starting a pull to its data in hand.",
            labels=["engine"],
        )
        seconds.add_metric([engine], stats.load_seconds)
        yield seconds
        loads = CounterMetricFamily(
            "tandem:kv_transfer_loads",
            "Consumer: KV loads by outcome (failed: the request computed its prompt).",
            labels=["engine", "outcome"],
        )
        loads.add_metric([engine, "ok"], stats.loads_ok)
        loads.add_metric([engine, "failed"], stats.loads_failed)
        yield loads
        failures = CounterMetricFamily(
            "tandem:kv_transfer_failures",
            "Consumer: KV loads that failed (producer gone, expired, refused, bad data).",
            labels=["engine"],
        )
        failures.add_metric([engine], stats.loads_failed)
        yield failures
        served = CounterMetricFamily(
            "tandem:kv_transfer_pulls_served",
            "Producer: pulls streamed to the end.",
            labels=["engine"],
        )
        served.add_metric([engine], stats.pulls_served)
        yield served
        expired = CounterMetricFamily(
            "tandem:kv_transfer_expired",
            "Producer: held transfers freed unpulled when they expired.",
            labels=["engine"],
        )
        expired.add_metric([engine], stats.expired)
        yield expired
        held = GaugeMetricFamily(
            "tandem:kv_transfer_held",
            "Producer: finished requests whose KV is held for a consumer now.",
            labels=["engine"],
        )
        held.add_metric([engine], self.connector.num_held_transfers)
        yield held


def trace_metadata(headers: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """The request's W3C trace headers as gRPC metadata of a pull."""
    return [(k, v) for k, v in (headers or {}).items() if k in TRACE_KEYS]


def emit_span(
    tracing: Tracing | None,
    name: str,
    parent_headers: Mapping[str, str] | None,
    start: float,
    end: float,
    attributes: dict[str, Any],
    ok: bool,
) -> None:
    """One finished span (``start``/``end``: time.time() seconds) under the request's trace."""
    if tracing is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span = tracing.tracer.start_span(
        name, context=tracing.extract(dict(parent_headers or {})), start_time=wall_ns(start)
    )
    span.set_attributes(attributes)
    if not ok:
        span.set_status(Status(StatusCode.ERROR, "KV transfer failed"))
    span.end(end_time=wall_ns(end))
