"""Frontend-side metrics (Prometheus): what the client sees, and engine health.

The frontend exports per-request results and client-visible latencies, measured when
engine outputs reach the frontend: time to first token, inter-token latency and
end-to-end latency (from the moment ``Generate`` arrived), finished requests by finish
reason (stop strings and client cancels are only known here), prompt and generation
token counts, and whether each engine is up. Queue/prefill/decode times, KV-cache and
scheduler state are the engines' (``engine_service/metrics.py``).

Several frontend processes (``tandem serve --frontends N``) share one set of series
through prometheus_client's multiprocess mode: with ``PROMETHEUS_MULTIPROC_DIR`` set,
each process writes its values there and any of them serves the sum
(``serving_registry``); the engine gauges then hold the least (health) and the sum
(in-flight requests) over the live processes, refreshed every second.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess() -> bool:
    """Whether this process shares its metrics with others (MULTIPROC_ENV is set)."""
    return bool(os.environ.get(MULTIPROC_ENV))


def serving_registry() -> CollectorRegistry:
    """The registry to serve /metrics from: in multiprocess mode one that reads every
    process's values (the metrics themselves then live in a private registry)."""
    registry = CollectorRegistry()
    if multiprocess():
        from prometheus_client import multiprocess as mp

        mp.MultiProcessCollector(registry)
    return registry

FINISH_REASONS = ("stop", "length", "abort", "error", "deadline")

TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0, 30.0,
)
E2E_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
    1800.0,
)


class FrontendMetrics:
    """The frontend's Prometheus metrics, in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.request_success = Counter(
            "tandem:request_success",
            "Finished requests (each of the n sequences of a request counts) by finish reason.",
            ["finished_reason"],
            registry=registry,
        )
        self._by_reason = {r: self.request_success.labels(finished_reason=r) for r in FINISH_REASONS}
        self.prompt_tokens = Counter(
            "tandem:prompt_tokens",
            "Prompt tokens of the sequences that produced a first token.",
            registry=registry,
        )
        self.generation_tokens = Counter(
            "tandem:generation_tokens", "Tokens generated (received from the engines).", registry=registry
        )
        self.ttft = Histogram(
            "tandem:time_to_first_token_seconds",
            "Request arrival at the frontend to its first token reaching the frontend, per sequence.",
            registry=registry,
            buckets=TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "tandem:inter_token_latency_seconds",
            "Time between successive tokens of a sequence reaching the frontend (one sample per "
            "token after the first; tokens that arrive together, from engine steps merged while "
            "the frontend was behind, share the time since the previous arrival evenly).",
            registry=registry,
            buckets=ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "Request arrival at the frontend to its last output, per request (aborted ones included).",
            registry=registry,
            buckets=E2E_BUCKETS,
        )
        self.request_migrations = Counter(
            "tandem:request_migrations",
            "Requests continued on another engine after losing theirs, by reason (engine_dead: "
            "its stream to the engine broke; engine_drained: the engine's drain timeout ended it).",
            ["reason"],
            registry=registry,
        )
        self.request_failures = Counter(
            "tandem:request_failures",
            "Requests that ended with an error status, by gRPC code (DEADLINE_EXCEEDED: the "
            "deadline passed; RESOURCE_EXHAUSTED: refused by the frontend's bound or by every "
            "engine's queue; INVALID_ARGUMENT, INTERNAL: refused or failed by an engine).",
            ["code"],
            registry=registry,
        )
        self.deadline_exceeded = Counter(
            "tandem:request_deadline_exceeded",
            "Requests that ended with DEADLINE_EXCEEDED because their deadline passed in an engine "
            "or before one was reached.",
            registry=registry,
        )
        self.engine_healthy = Gauge(
            "tandem:engine_healthy",
            "1 while the frontend's stream to the engine is up, else 0.",
            ["engine", "address"],
            registry=registry,
            multiprocess_mode="livemin",  # up only where every frontend process reaches it
        )

        self.engine_in_flight = Gauge(
            "tandem:engine_in_flight_requests",
            "This frontend's requests on the engine that have not finished.",
            ["engine", "address"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        # Multiprocess mode reads values from files, not callbacks: the callbacks of the
        # watched engines, pushed by ``refresh``.
        self._watched: dict[tuple[str, str], tuple[Callable[[], bool], Callable[[], int] | None]] = {}

    def watch_engine(
        self,
        index: int,
        address: str,
        is_up: Callable[[], bool],
        in_flight: Callable[[], int] | None = None,
    ) -> None:
        """Report ``is_up()`` as the engine's health (and ``in_flight()`` as its
        requests), read at every scrape (in multiprocess mode: every ``refresh``), until
        ``unwatch_engine``."""
        if multiprocess():
            self._watched[(str(index), address)] = (is_up, in_flight)
            self.refresh()
            return
        self.engine_healthy.labels(engine=str(index), address=address).set_function(
            lambda: 1.0 if is_up() else 0.0
        )
        if in_flight is not None:
            self.engine_in_flight.labels(engine=str(index), address=address).set_function(
                lambda: float(in_flight())
            )

    def unwatch_engine(self, index: int, address: str) -> None:
        """The engine left for good: drop its series (engines come and go with discovery)."""
        self._watched.pop((str(index), address), None)
        for gauge in (self.engine_healthy, self.engine_in_flight):
            with contextlib.suppress(KeyError):
                gauge.remove(str(index), address)

    def refresh(self) -> None:
        """Write the watched engines' gauges (multiprocess mode; no-op otherwise)."""
        for (index, address), (is_up, in_flight) in list(self._watched.items()):
            self.engine_healthy.labels(engine=index, address=address).set(1.0 if is_up() else 0.0)
            if in_flight is not None:
                self.engine_in_flight.labels(engine=index, address=address).set(float(in_flight()))

    def record_finished(self, finish_reasons: Iterable[str], e2e_seconds: float) -> None:
        for reason in finish_reasons:
            child = self._by_reason.get(reason)
            if child is None:
                child = self.request_success.labels(finished_reason=reason)
            child.inc()
        self.e2e.observe(e2e_seconds)


    def record_failure(self, code: str) -> None:
        """One request ended with status ``code`` (a gRPC status name)."""
        self.request_failures.labels(code=code).inc()
        if code == "DEADLINE_EXCEEDED":
            self.deadline_exceeded.inc()


class SequenceTimes:
    """Token arrival times of one engine request (one of a request's n sequences)."""

    __slots__ = ("arrival", "first_token", "last_token", "num_prompt_tokens")

    def __init__(self, arrival: float, num_prompt_tokens: int) -> None:
        self.arrival = arrival
        self.num_prompt_tokens = num_prompt_tokens
        self.first_token: float | None = None
        self.last_token: float | None = None

    def on_tokens(self, now: float, num_tokens: int, metrics: FrontendMetrics | None) -> None:
        first = self.last_token is None
        if first:
            self.first_token = now
        if metrics is not None:
            metrics.generation_tokens.inc(num_tokens)
            if first:
                metrics.ttft.observe(now - self.arrival)
                metrics.prompt_tokens.inc(self.num_prompt_tokens)
                gap, samples = 0.0, num_tokens - 1
            else:
                gap, samples = (now - self.last_token) / num_tokens, num_tokens  # type: ignore[operator]
            for _ in range(samples):
                metrics.itl.observe(gap)
        self.last_token = now
