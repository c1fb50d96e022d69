"""Tracing: span bookkeeping in the engine (no processes), and end to end through a real
OTLP/gRPC receiver that an engine and a frontend process export to.

The receiver is this module's own ``TraceServiceServicer`` on a free localhost port; the
services find it only through the standard OTel environment variables.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.proto.common.v1 import common_pb2 as otel_common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from engine_service.tracing import RequestSpanEmitter
from tandem import telemetry
from tandem.protocol.outputs import FinishReason
from tandem.telemetry import Tracing
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import (
    ADMIN_METADATA,
    START_TIMEOUT,
    ServiceProcess,
    start_engine,
    start_frontend,
)
from tests.factories import fake_step, make_request, make_scheduler

pytestmark = pytest.mark.timeout(180)

PROMPT_IDS = [1, 17, 250, 999, 42, 7, 512, 300, 64]
MAX_TOKENS = 5
TEMPERATURE = 0.5  # exact in float32, as the proto carries it
TOP_P = 0.75
SPAN_WAIT = 60.0  # seconds to wait for spans to arrive (batching + busy cores)


# ---- unit: timestamps stamped by the scheduler --------------------------------------------


def test_scheduler_stamps_times_as_events_happen() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    request = make_request(20, max_tokens=3)
    times = request.times
    sched.add_request(request)
    assert times.first_scheduled is None and times.first_token is None

    steps = []
    while sched.num_unfinished:
        before = time.monotonic()
        out, finished = fake_step(sched)
        steps.append((before, time.monotonic(), out, finished))

    # 20 prompt tokens at 8 per step: chunks of 8, 8, 4, then two decodes.
    assert [c[2] for c in times.prefill_chunks] == [8, 8, 4]
    assert len(steps) == 5
    assert steps[0][0] <= times.first_scheduled <= steps[0][1]
    for (start, end, _), (t0, t1, _, _) in zip(times.prefill_chunks, steps):
        assert t0 <= start <= end <= t1
    # The first token comes with the last prefill chunk, the finish with the last decode.
    assert times.first_token == times.prefill_chunks[-1][1]
    assert steps[2][0] <= times.first_token <= steps[2][1]
    assert steps[-1][0] <= times.finished <= steps[-1][1]
    assert times.arrival <= times.first_scheduled <= times.first_token <= times.finished
    assert times.queue_time == times.first_scheduled - times.arrival
    assert times.prefill_time == times.first_token - times.first_scheduled
    assert times.decode_time == times.finished - times.first_token
    assert times.e2e_time == times.finished - times.arrival
    assert times.preemptions == []
    # Wall-clock mapping: one offset, sampled at arrival.
    assert abs(times.wall(times.arrival) - time.time()) < 60
    assert times.wall(times.finished) - times.wall(times.arrival) == pytest.approx(times.e2e_time, abs=1e-6)
    assert sched.take_token_counts() == (20, 3)
    assert sched.take_token_counts() == (0, 0)


def test_preemption_and_abort_are_stamped() -> None:
    # 4 blocks of 4 tokens: two 6-token requests fit their prompts, then run out and one
    # is preempted (recomputed later); a third request is aborted while waiting.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_request(6, max_tokens=6, ignore_eos=True), make_request(6, max_tokens=6, ignore_eos=True)
    waiting = make_request(4, max_tokens=2)
    for r in (a, b):
        sched.add_request(r)
    fake_step(sched)
    sched.add_request(waiting)
    (aborted,) = sched.finish_requests([waiting.request_id], FinishReason.ABORT)
    assert aborted.times.finished is not None and aborted.times.first_scheduled is None
    while sched.num_unfinished:
        fake_step(sched)
    preempted = [r for r in (a, b) if r.times.preemptions]
    assert preempted, "the set-up must preempt"
    for r in preempted:
        assert r.num_preemptions == len(r.times.preemptions)
        assert all(r.times.first_token <= t <= r.times.finished for t in r.times.preemptions)
        # Recompute after a preemption is not a prefill chunk: the prompt went in one chunk.
        assert [c[2] for c in r.times.prefill_chunks] == [6]


# ---- unit: spans built from the stamped times ------------------------------------------


def _in_memory_tracing(sampler: Any = None) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "unit"}), sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider.get_tracer("test"), provider), exporter


def _finished_request(chunks: int, preempt: bool = False):  # type: ignore[no-untyped-def]
    """A request run through a scheduler whose budget splits its prompt in ``chunks``."""
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    request = make_request(8 * chunks, max_tokens=4, ignore_eos=True, top_p=0.5, seed=3)
    request.trace_headers = None
    sched.add_request(request)
    while sched.num_unfinished:
        fake_step(sched)
    if preempt:  # a preemption event, stamped between first token and finish
        t = request.times
        t.preemptions.append((t.first_token + t.finished) / 2)
    return request


def test_request_spans_follow_the_stamped_times() -> None:
    tracing, exporter = _in_memory_tracing()
    parent = tracing.tracer.start_span("frontend")
    request = _finished_request(chunks=3, preempt=True)
    request.trace_headers = tracing.inject(parent)
    RequestSpanEmitter(tracing, "tiny", engine_index=2).emit(request)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    chunks = [s for s in exporter.get_finished_spans() if s.name == "prefill_chunk"]
    assert set(spans) == {"llm_request", "queue", "prefill", "prefill_chunk", "decode"}
    assert len(chunks) == 3

    root, t = spans["llm_request"], request.times

    def ns(x: float) -> int:
        return telemetry.wall_ns(t.wall(x))

    assert root.kind == trace.SpanKind.SERVER
    assert root.parent.span_id == parent.get_span_context().span_id
    assert root.context.trace_id == parent.get_span_context().trace_id
    assert (root.start_time, root.end_time) == (ns(t.arrival), ns(t.finished))
    assert (spans["queue"].start_time, spans["queue"].end_time) == (ns(t.arrival), ns(t.first_scheduled))
    assert (spans["prefill"].start_time, spans["prefill"].end_time) == (ns(t.first_scheduled), ns(t.first_token))
    assert (spans["decode"].start_time, spans["decode"].end_time) == (ns(t.first_token), ns(t.finished))
    for name in ("queue", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id
    for chunk, (start, end, n) in zip(sorted(chunks, key=lambda s: s.start_time), t.prefill_chunks):
        assert chunk.parent.span_id == spans["prefill"].context.span_id
        assert (chunk.start_time, chunk.end_time) == (ns(start), ns(end))
        assert chunk.attributes["tandem.chunk_tokens"] == n
    (event,) = root.events
    assert event.name == "preempted" and event.timestamp == ns(t.preemptions[0])

    a = root.attributes
    assert a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == 0.5
    assert a["gen_ai.request.seed"] == 3
    assert a["gen_ai.usage.input_tokens"] == 24
    assert a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.response.id"] == request.request_id
    assert a["tandem.engine_index"] == 2
    assert a[telemetry.LATENCY_QUEUE] == t.queue_time
    assert a[telemetry.LATENCY_TTFT] == t.time_to_first_token
    assert a[telemetry.LATENCY_PREFILL] == t.prefill_time
    assert a[telemetry.LATENCY_DECODE] == t.decode_time
    assert a[telemetry.LATENCY_E2E] == t.e2e_time


def test_single_chunk_prefill_has_no_chunk_spans_and_root_without_parent() -> None:
    tracing, exporter = _in_memory_tracing()
    RequestSpanEmitter(tracing, "tiny", 0).emit(_finished_request(chunks=1))
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["decode", "llm_request", "prefill", "queue"]
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
    assert root.parent is None


def test_unsampled_requests_build_no_spans() -> None:
    tracing, exporter = _in_memory_tracing(sampler=ALWAYS_OFF)
    RequestSpanEmitter(tracing, "tiny", 0).emit(_finished_request(chunks=2))
    assert exporter.get_finished_spans() == ()


def test_propagation_continues_the_callers_trace() -> None:
    tracing, exporter = _in_memory_tracing()
    trace_id, span_id = random.getrandbits(128) | 1, random.getrandbits(64) | 1
    incoming = {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01", "tracestate": "vendor=x"}
    span = tracing.tracer.start_span("s", context=tracing.extract(incoming))
    out = tracing.inject(span)
    span.end()
    assert out["traceparent"].split("-")[1] == f"{trace_id:032x}"
    assert out["traceparent"].split("-")[2] == f"{span.get_span_context().span_id:016x}"
    assert out["tracestate"] == "vendor=x"
    assert exporter.get_finished_spans()[0].parent.span_id == span_id
    assert tracing.extract(None) is None and tracing.extract({}) is None


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_tracing_is_configured_by_the_otel_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], on: bool
) -> None:
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    tracing = telemetry.tracing_from_env("tandem-test")
    assert (tracing is not None) == on
    if tracing is not None:
        assert tracing.provider.resource.attributes["service.name"] == "tandem-test"
        tracing.shutdown()


def test_export_failures_are_logged_once_a_minute_with_a_count() -> None:
    now = [100.0]
    throttle = telemetry.ThrottledLog(60.0, clock=lambda: now[0])

    def record(level: int, msg: str = "Failed to export %s to %s", args: tuple = ("traces", "x:4317")):
        return logging.LogRecord(telemetry.OTLP_EXPORTER_LOGGER, level, __file__, 1, msg, args, None)

    assert throttle.filter(record(logging.WARNING))  # the first at once
    held = [throttle.filter(record(level)) for level in (logging.WARNING, logging.ERROR, logging.ERROR)]
    assert held == [False, False, False]
    assert throttle.filter(record(logging.DEBUG))  # below WARNING: untouched, not counted
    now[0] += 61.0
    later = record(logging.ERROR)
    assert throttle.filter(later)
    assert later.getMessage() == "Failed to export traces to x:4317 (3 more held back in the last 61 s)"
    assert not throttle.filter(record(logging.ERROR))
    now[0] += 60.0
    quiet_again = record(logging.ERROR)
    assert throttle.filter(quiet_again) and "(1 more held back" in quiet_again.getMessage()


def test_an_otlp_exporter_gets_its_log_throttled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    exporter_logger = logging.getLogger(telemetry.OTLP_EXPORTER_LOGGER)
    before = list(exporter_logger.filters)
    try:
        for _ in range(2):
            tracing = telemetry.tracing_from_env("tandem-test")
            assert tracing is not None
            tracing.shutdown()
        added = [f for f in exporter_logger.filters if f not in before]
        assert sum(isinstance(f, telemetry.ThrottledLog) for f in exporter_logger.filters) == 1
        assert len(added) <= 1
    finally:
        exporter_logger.filters[:] = before


def test_service_name_and_sampler_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "custom")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    tracing = telemetry.tracing_from_env("tandem-test")
    assert tracing is not None
    try:
        assert tracing.provider.resource.attributes["service.name"] == "custom"
        assert not tracing.tracer.start_span("x").is_recording()
    finally:
        tracing.shutdown()


# ---- end to end: engine + frontend processes -> an OTLP/gRPC receiver -----------------------


@dataclass
class ReceivedSpan:
    service: str
    span: trace_pb2.Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def attrs(self) -> dict[str, Any]:
        return {kv.key: _value(kv.value) for kv in self.span.attributes}


def _value(v: otel_common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span with its resource's service.name."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Condition()

    def Export(self, request: Any, context: Any) -> Any:
        with self._lock:
            for rs in request.resource_spans:
                service = {kv.key: _value(kv.value) for kv in rs.resource.attributes}.get("service.name", "")
                for scope in rs.scope_spans:
                    self.spans.extend(ReceivedSpan(service, s) for s in scope.spans)
            self._lock.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, check: Callable[[list[ReceivedSpan]], bool], what: str) -> list[ReceivedSpan]:
        deadline = time.monotonic() + SPAN_WAIT
        with self._lock:
            while not check(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    shown = sorted({(s.service, s.name) for s in self.spans})
                    raise AssertionError(f"no {what} after {SPAN_WAIT:.0f}s; received {shown}")
                self._lock.wait(left)
            return list(self.spans)


@dataclass
class TracedStack:
    receiver: Receiver
    engine: ServiceProcess
    frontend: ServiceProcess


@pytest.fixture(scope="module")
def traced(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedStack]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    log_dir: Path = tmp_path_factory.mktemp("tracing_logs")

    def env(service: str) -> dict[str, str]:
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_SERVICE_NAME": service,
            "OTEL_TRACES_SAMPLER": "always_on",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    engine = start_engine(tiny_llama_dir, 0, log_dir, env=env("tandem-engine"))
    frontend = start_frontend(tiny_llama_dir, [engine.address], log_dir, env=env("tandem-frontend"))
    try:
        engine.wait_serving(START_TIMEOUT)
        frontend.wait_serving(START_TIMEOUT)
        yield TracedStack(receiver, engine, frontend)
    finally:
        frontend.stop()
        engine.stop()
        server.stop(0)


def _generate(stack: TracedStack, metadata: list[tuple[str, str]] | None) -> list[Any]:
    request = frontend_pb2.GenerateRequest(
        prompt_token_ids=frontend_pb2.TokenIds(token_ids=PROMPT_IDS),
        sampling_params=common_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_p=TOP_P, seed=7, ignore_eos=True,
            output_kind=common_pb2.OUTPUT_KIND_DELTA,
        ),
    )
    with grpc.insecure_channel(stack.frontend.address) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)
        return list(stub.Generate(request, metadata=metadata, timeout=60))


def _request_spans(stack: TracedStack, trace_id: bytes | None = None) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """The frontend's request span of ``trace_id`` (None: the one without a remote parent)
    and every engine span of its trace."""

    def frontend_span(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
        for s in spans:
            ours = (trace_id is None and not s.span.parent_span_id) or s.span.trace_id == trace_id
            if s.service == "tandem-frontend" and s.name == "tandem.v1.Generation/Generate" and ours:
                return s
        return None

    def complete(spans: list[ReceivedSpan]) -> bool:
        front = frontend_span(spans)
        if front is None:
            return False
        names = {s.name for s in spans if s.span.trace_id == front.span.trace_id and s.service == "tandem-engine"}
        return {"llm_request", "queue", "prefill", "decode"} <= names

    spans = stack.receiver.wait_for(complete, "frontend + engine request spans")
    front = frontend_span(spans)
    assert front is not None
    engine = [s for s in spans if s.span.trace_id == front.span.trace_id and s.service == "tandem-engine"]
    return front, engine


def test_spans_from_both_services_join_the_callers_trace(traced: TracedStack) -> None:
    trace_id, parent_id = random.getrandbits(128) | 1, random.getrandbits(64) | 1
    traceparent = f"00-{trace_id:032x}-{parent_id:016x}-01"
    responses = _generate(traced, [("traceparent", traceparent), ("tracestate", "tandem=test")])
    generated = sum(len(r.outputs[0].token_ids) for r in responses)
    assert generated == MAX_TOKENS

    front, engine = _request_spans(traced, trace_id.to_bytes(16, "big"))
    by_name = {s.name: s for s in engine}
    root = by_name["llm_request"]
    assert front.service != root.service
    # One trace: the caller's -> the frontend's request span -> the engine's request span.
    assert front.span.trace_id == root.span.trace_id == trace_id.to_bytes(16, "big")
    assert front.span.parent_span_id == parent_id.to_bytes(8, "big")
    assert front.span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert root.span.parent_span_id == front.span.span_id
    assert root.span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert front.span.trace_state == "tandem=test"
    # The engine's work lies within the frontend's window; its phases tile the request.
    assert front.span.start_time_unix_nano <= root.span.start_time_unix_nano
    assert root.span.end_time_unix_nano <= front.span.end_time_unix_nano
    queue, prefill, decode = by_name["queue"], by_name["prefill"], by_name["decode"]
    for child in (queue, prefill, decode):
        assert child.span.parent_span_id == root.span.span_id
    assert queue.span.start_time_unix_nano == root.span.start_time_unix_nano
    assert queue.span.end_time_unix_nano == prefill.span.start_time_unix_nano
    assert prefill.span.end_time_unix_nano == decode.span.start_time_unix_nano
    assert decode.span.end_time_unix_nano == root.span.end_time_unix_nano

    for span in (front, root):
        a = span.attrs
        assert a["gen_ai.request.model"] == Path(traced_model_dir(traced)).name, span.service
        assert a["gen_ai.request.max_tokens"] == MAX_TOKENS
        assert a["gen_ai.request.temperature"] == TEMPERATURE
        assert a["gen_ai.request.top_p"] == TOP_P
        assert a["gen_ai.request.seed"] == 7
        assert a["gen_ai.usage.input_tokens"] == len(PROMPT_IDS)
        assert a["gen_ai.usage.output_tokens"] == MAX_TOKENS
        assert a["gen_ai.usage.cache_read.input_tokens"] == 0
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert 0 < a[telemetry.LATENCY_TTFT] <= a[telemetry.LATENCY_E2E]
    ra = root.attrs
    assert ra[telemetry.LATENCY_QUEUE] >= 0
    assert ra[telemetry.LATENCY_PREFILL] > 0 and ra[telemetry.LATENCY_DECODE] > 0
    assert ra[telemetry.LATENCY_QUEUE] + ra[telemetry.LATENCY_PREFILL] == pytest.approx(ra[telemetry.LATENCY_TTFT])
    duration = (root.span.end_time_unix_nano - root.span.start_time_unix_nano) / 1e9
    assert ra[telemetry.LATENCY_E2E] == pytest.approx(duration, abs=1e-6)
    assert front.attrs["gen_ai.operation.name"] == "text_completion"


def traced_model_dir(stack: TracedStack) -> str:
    args = stack.engine.proc.args
    return str(args[args.index("--model") + 1])


def test_a_request_without_traceparent_starts_a_trace_at_the_frontend(traced: TracedStack) -> None:
    _generate(traced, None)
    front, engine = _request_spans(traced, None)
    (root,) = [s for s in engine if s.name == "llm_request"]
    assert root.span.parent_span_id == front.span.span_id


def test_engine_start_up_and_utility_calls_are_traced(traced: TracedStack) -> None:
    with grpc.insecure_channel(traced.engine.address) as channel:
        reply = engine_pb2_grpc.EngineCoreStub(channel).ResetPrefixCache(
            engine_pb2.ResetPrefixCacheRequest(), timeout=30, metadata=ADMIN_METADATA
        )
    assert reply.success

    def ready(spans: list[ReceivedSpan]) -> bool:
        names = {s.name for s in spans if s.service == "tandem-engine"}
        return {"engine_startup", "load_model", "allocate_kv_cache", "warm_up", "utility reset_prefix_cache"} <= names

    spans = [s for s in traced.receiver.wait_for(ready, "start-up and utility spans") if s.service == "tandem-engine"]
    by_name = {s.name: s for s in spans}
    startup = by_name["engine_startup"]
    assert not startup.span.parent_span_id
    for phase in ("load_model", "allocate_kv_cache", "warm_up"):
        child = by_name[phase].span
        assert child.trace_id == startup.span.trace_id and child.parent_span_id == startup.span.span_id
        assert startup.span.start_time_unix_nano <= child.start_time_unix_nano
        assert child.end_time_unix_nano <= startup.span.end_time_unix_nano
    assert by_name["allocate_kv_cache"].attrs["tandem.kv_cache.num_blocks"] > 0
    utility = by_name["utility reset_prefix_cache"]
    assert utility.span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert utility.attrs["tandem.utility.method"] == "reset_prefix_cache"
