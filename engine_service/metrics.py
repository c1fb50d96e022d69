"""Engine-side metrics (Prometheus) and the periodic stats log line.

Both consume the ``EngineCoreOutputs`` of each step on the service's output pump thread,
never on the engine's step loop: the loop only stamps times into each ``Request`` and
hands finished requests over in ``IterationStats``.

The engine exports what only it knows: its queue, KV cache, prefix cache, preemptions,
and the queue/prefill/decode split of each request. Client-visible latencies (TTFT,
inter-token, end-to-end), finish reasons and token counts are the frontend's
(``frontend_service/metrics.py``). docs/metrics-and-tracing.md lists every metric.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem.protocol.outputs import EngineCoreOutputs, ErrorCode, SchedulerStats

logger = logging.getLogger(__name__)

# Seconds. Queue and prefill times range from sub-millisecond (idle GPU) to minutes
# (a long queue); decode and whole-request times from tens of ms to many minutes.
SHORT_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)
LONG_LATENCY_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
    1800.0,
)


# Per engine step: requests in the batch and tokens computed (vLLM's iteration-tokens
# buckets, extended to both ends).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class HitRateWindow:
    """Prefix-cache hit rate over the most recent ``max_lookups`` steps that looked up
    the cache (each such step admitted at least one request)."""

    def __init__(self, max_lookups: int = 1000) -> None:
        self._window: deque[tuple[int, int]] = deque()
        self._max = max_lookups
        self._queries = 0
        self._hits = 0

    def add(self, queries: int, hits: int) -> None:
        if queries <= 0:
            return
        self._window.append((queries, hits))
        self._queries += queries
        self._hits += hits
        if len(self._window) > self._max:
            q, h = self._window.popleft()
            self._queries -= q
            self._hits -= h

    @property
    def rate(self) -> float:
        return self._hits / self._queries if self._queries else 0.0


class EngineMetrics:
    """The engine's Prometheus metrics, in ``registry``, labelled with the engine index."""

    def __init__(self, registry: CollectorRegistry, engine_index: int) -> None:
        label = {"engine": str(engine_index)}
        names = ["engine"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=registry).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, registry=registry, buckets=buckets).labels(**label)

        self.running = gauge("tandem:num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("tandem:num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).")
        self.kv_usage = gauge("tandem:kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0 to 1.")
        self.hit_rate_gauge = gauge(
            "tandem:prefix_cache_hit_rate",
            "Prefix-cache hit rate (hit tokens / looked-up tokens) over the last 1000 steps that looked it up.",
        )
        self.prefix_queries = counter("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("tandem:prefix_cache_hits", "Looked-up prompt tokens found in the prefix cache.")
        self.preemptions = counter("tandem:num_preemptions", "Requests preempted (KV blocks freed, recomputed later).")
        self.queue_time = histogram(
            "tandem:request_queue_time_seconds",
            "Engine arrival to first scheduled, per finished request.", SHORT_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "tandem:request_prefill_time_seconds",
            "First scheduled to first token (the whole, possibly chunked, prefill), per finished request.",
            SHORT_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "tandem:request_decode_time_seconds",
            "First token to finish, per finished request.", LONG_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "tandem:request_inference_time_seconds",
            "First scheduled to finish (prefill + decode, preemptions included), per finished request.",
            LONG_LATENCY_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "tandem:iteration_tokens_total",
            "Tokens computed per engine step (prefill chunks and decodes; vLLM's iteration_tokens).",
            BATCH_BUCKETS,
        )
        self.iteration_requests = histogram(
            "tandem:iteration_requests", "Requests in each engine step's batch.", BATCH_BUCKETS
        )
        self.hit_rate = HitRateWindow()
        self.deadline_exceeded = counter(
            "tandem:request_deadline_exceeded_total",
            "Requests ended with DEADLINE_EXCEEDED (dropped while waiting, aborted while running, "
            "or already expired at arrival).",
        )
        self.rejected = counter(
            "tandem:request_rejected_total",
            "Requests refused at arrival with RESOURCE_EXHAUSTED (waiting queue full).",
        )
        # Speculative decoding (vLLM's spec_decode metrics).
        self.spec_drafts = counter(
            "tandem:spec_decode_num_drafts", "Drafts verified (a request's drafts in one step count once)."
        )
        self.spec_draft_tokens = counter("tandem:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter(
            "tandem:spec_decode_num_accepted_tokens", "Draft tokens accepted (emitted as proposed)."
        )
        self._spec_per_pos = Counter(
            "tandem:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of their draft (0: the first drafted token).",
            [*names, "position"], registry=registry,
        )
        self._label = label

    def record(self, outs: EngineCoreOutputs) -> None:
        self._record_errors(outs)
        stats = outs.scheduler_stats
        if stats is not None:
            self.running.set(stats.num_running_reqs)
            self.waiting.set(stats.num_waiting_reqs)
            self.kv_usage.set(stats.kv_cache_usage)
            if stats.prefix_cache_queries:
                self.prefix_queries.inc(stats.prefix_cache_queries)
                self.prefix_hits.inc(stats.prefix_cache_hits)
                self.hit_rate.add(stats.prefix_cache_queries, stats.prefix_cache_hits)
                self.hit_rate_gauge.set(self.hit_rate.rate)
            if stats.num_preemptions:
                self.preemptions.inc(stats.num_preemptions)
        iteration = outs.iteration_stats
        if iteration is None:
            return
        if iteration.num_scheduled_reqs:
            self.iteration_tokens.observe(iteration.num_scheduled_tokens)
            self.iteration_requests.observe(iteration.num_scheduled_reqs)
        spec = iteration.spec_decoding
        if spec is not None:
            self.spec_drafts.inc(spec.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
            for pos, count in enumerate(spec.accepted_per_pos):
                self._spec_per_pos.labels(position=str(pos), **self._label).inc(count)
        for request in iteration.finished:
            times = request.times
            for histogram, value in (
                (self.queue_time, times.queue_time),
                (self.prefill_time, times.prefill_time),
                (self.decode_time, times.decode_time),
                (self.inference_time, times.inference_time),
            ):
                if value is not None:
                    histogram.observe(value)

    def _record_errors(self, outs: EngineCoreOutputs) -> None:
        for out in outs.outputs:
            if out.error is None:
                continue
            if out.error.code == ErrorCode.DEADLINE_EXCEEDED:
                self.deadline_exceeded.inc()
            elif out.error.code == ErrorCode.RESOURCE_EXHAUSTED:
                self.rejected.inc()


class StatsLogger:
    """Logs one line every ``interval`` seconds, as vLLM does::

        engine 0: prompt throughput 812.4 tok/s, generation throughput 95.1 tok/s, running 8 reqs,
        waiting 0 reqs, KV cache usage 3.1%, prefix cache hit rate 42.0%

    (and where drafts were verified in the interval ", spec decode: mean accepted length
    2.31, acceptance rate 32.8%": tokens per verified step, accepted / drafted tokens).

    Prompt throughput counts the prompt tokens of requests that got their first token in
    the interval; generation throughput the tokens sampled. Quiet while the engine idles.
    """

    def __init__(self, engine_index: int, interval: float, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self.engine_index = engine_index
        self.interval = interval
        self._clock = clock
        self._last_log = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._spec = [0, 0, 0]  # speculative decoding: drafts, draft tokens, accepted tokens
        self._stats = SchedulerStats()
        self._hit_rate = HitRateWindow()
        self._idle_logged = True  # nothing to say before the first request

    def record(self, outs: EngineCoreOutputs) -> None:
        if outs.scheduler_stats is not None:
            self._stats = outs.scheduler_stats
            self._hit_rate.add(self._stats.prefix_cache_queries, self._stats.prefix_cache_hits)
        if outs.iteration_stats is not None:
            self._prompt_tokens += outs.iteration_stats.num_prompt_tokens
            self._generation_tokens += outs.iteration_stats.num_generation_tokens
            spec = outs.iteration_stats.spec_decoding
            if spec is not None:
                self._spec[0] += spec.num_drafts
                self._spec[1] += spec.num_draft_tokens
                self._spec[2] += spec.num_accepted_tokens

    def seconds_until_due(self) -> float:
        return max(0.0, self._last_log + self.interval - self._clock())

    def maybe_log(self) -> str | None:
        """Log (and return) the line if the interval has passed and there is news."""
        now = self._clock()
        elapsed = now - self._last_log
        if elapsed < self.interval:
            return None
        stats = self._stats
        idle = (
            not self._prompt_tokens
            and not self._generation_tokens
            and not stats.num_running_reqs
            and not stats.num_waiting_reqs
        )
        self._last_log = now
        if idle and self._idle_logged:
            return None
        self._idle_logged = idle
        line = (
            f"engine {self.engine_index}: "
            f"prompt throughput {self._prompt_tokens / elapsed:.1f} tok/s, "
            f"generation throughput {self._generation_tokens / elapsed:.1f} tok/s, "
            f"running {stats.num_running_reqs} reqs, waiting {stats.num_waiting_reqs} reqs, "
            f"KV cache usage {stats.kv_cache_usage * 100:.1f}%, "
            f"prefix cache hit rate {self._hit_rate.rate * 100:.1f}%"
        )
        drafts, draft_tokens, accepted = self._spec
        if drafts:
            line += (f", spec decode: mean accepted length {1 + accepted / drafts:.2f}, "
                     f"acceptance rate {100 * accepted / draft_tokens:.1f}%")
        self._spec = [0, 0, 0]
        self._prompt_tokens = self._generation_tokens = 0
        logger.info(line)
        return line
