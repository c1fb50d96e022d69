"""Prometheus metrics and the engine's stats log line.

Unit tests feed synthetic step outputs to the engine's metrics and stats logger; the end
to end test runs an engine and a frontend with metrics ports, sends requests with known
token counts, scrapes both ``/metrics`` and checks every counter and histogram moved by
exactly what the requests did.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine_service.metrics import EngineMetrics, HitRateWindow, StatsLogger
from frontend_service.metrics import FrontendMetrics, SequenceTimes
from tandem.protocol.outputs import EngineCoreOutputs, IterationStats, SchedulerStats
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import START_TIMEOUT, ServiceProcess, free_port, start_engine, start_frontend
from tests.factories import fake_step, make_request, make_scheduler

pytestmark = pytest.mark.timeout(180)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# ---- unit ---------------------------------------------------------------------------------


def test_hit_rate_window_forgets_old_lookups() -> None:
    window = HitRateWindow(max_lookups=2)
    assert window.rate == 0.0
    window.add(100, 100)
    window.add(0, 0)  # no lookup: ignored
    window.add(100, 0)
    assert window.rate == 0.5
    window.add(100, 0)  # the first (all hits) falls out
    assert window.rate == 0.0


def _step(running: int, waiting: int, prompt: int, gen: int, finished=(), batch=(0, 0), **stats: float) -> EngineCoreOutputs:  # type: ignore[no-untyped-def]
    return EngineCoreOutputs(
        scheduler_stats=SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, **stats),  # type: ignore[arg-type]
        iteration_stats=IterationStats(prompt, gen, list(finished), *batch),
    )


def test_engine_metrics_record_steps_and_finished_requests() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, engine_index=3)
    sched = make_scheduler(max_num_batched_tokens=8)
    request = make_request(12, max_tokens=2)
    sched.add_request(request)
    while sched.num_unfinished:
        fake_step(sched)
    metrics.record(_step(2, 1, 12, 2, batch=(2, 13), kv_cache_usage=0.25, prefix_cache_queries=40,
                         prefix_cache_hits=30, num_preemptions=1))
    metrics.record(_step(1, 0, 0, 1, finished=[request], batch=(1, 1), prefix_cache_queries=10,
                         prefix_cache_hits=0))
    metrics.record(EngineCoreOutputs(iteration_stats=IterationStats()))  # nothing scheduled: not a batch
    metrics.record(EngineCoreOutputs())  # a utility answer: no stats

    def get(name: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "3"})

    assert get("tandem:num_requests_running") == 1
    assert get("tandem:num_requests_waiting") == 0
    assert get("tandem:kv_cache_usage_perc") == 0.0
    assert get("tandem:prefix_cache_queries_total") == 50
    assert get("tandem:prefix_cache_hits_total") == 30
    assert get("tandem:prefix_cache_hit_rate") == pytest.approx(0.6)
    assert get("tandem:num_preemptions_total") == 1
    assert (get("tandem:iteration_tokens_total_count"), get("tandem:iteration_tokens_total_sum")) == (2, 14)
    assert (get("tandem:iteration_requests_count"), get("tandem:iteration_requests_sum")) == (2, 3)
    assert registry.get_sample_value("tandem:iteration_requests_bucket", {"engine": "3", "le": "1.0"}) == 1
    t = request.times
    for name, expected in (
        ("tandem:request_queue_time_seconds", t.queue_time),
        ("tandem:request_prefill_time_seconds", t.prefill_time),
        ("tandem:request_decode_time_seconds", t.decode_time),
        ("tandem:request_inference_time_seconds", t.inference_time),
    ):
        assert get(name + "_count") == 1, name
        assert get(name + "_sum") == pytest.approx(expected), name


def test_stats_log_line_every_interval_and_quiet_when_idle() -> None:
    now = [100.0]
    logger = StatsLogger(engine_index=1, interval=10.0, clock=lambda: now[0])
    assert logger.maybe_log() is None  # not due
    assert logger.seconds_until_due() == 10.0
    logger.record(_step(3, 2, 500, 40, kv_cache_usage=0.125, prefix_cache_queries=400,
                        prefix_cache_hits=100))
    logger.record(_step(3, 2, 300, 60, kv_cache_usage=0.125))
    now[0] += 10.0
    line = logger.maybe_log()
    assert line == (
        "engine 1: prompt throughput 80.0 tok/s, generation throughput 10.0 tok/s, "
        "running 3 reqs, waiting 2 reqs, KV cache usage 12.5%, prefix cache hit rate 25.0%"
    )
    assert logger.maybe_log() is None  # just logged
    logger.record(_step(0, 0, 0, 0))
    now[0] += 10.0
    assert "generation throughput 0.0 tok/s, running 0 reqs" in (logger.maybe_log() or "")
    now[0] += 10.0
    assert logger.maybe_log() is None  # idle twice: quiet


def test_frontend_sequence_times_feed_ttft_itl_and_tokens() -> None:
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    seq = SequenceTimes(arrival=10.0, num_prompt_tokens=7)
    seq.on_tokens(10.5, 1, metrics)
    seq.on_tokens(10.75, 1, metrics)
    seq.on_tokens(11.0, 2, metrics)  # two steps merged: 0.125 s each
    metrics.record_finished(["length"], 1.25)
    get = registry.get_sample_value
    assert get("tandem:prompt_tokens_total") == 7
    assert get("tandem:generation_tokens_total") == 4
    assert get("tandem:time_to_first_token_seconds_count") == 1
    assert get("tandem:time_to_first_token_seconds_sum") == 0.5
    assert get("tandem:inter_token_latency_seconds_count") == 3  # one per token after the first
    assert get("tandem:inter_token_latency_seconds_sum") == 0.5
    assert get("tandem:e2e_request_latency_seconds_sum") == 1.25
    assert get("tandem:request_success_total", {"finished_reason": "length"}) == 1
    assert get("tandem:request_success_total", {"finished_reason": "stop"}) == 0
    up = [True]
    metrics.watch_engine(0, "h:1", lambda: up[0])
    assert get("tandem:engine_healthy", {"engine": "0", "address": "h:1"}) == 1
    up[0] = False
    assert get("tandem:engine_healthy", {"engine": "0", "address": "h:1"}) == 0


# ---- end to end -------------------------------------------------------------------------------


@dataclass
class MeteredStack:
    engine: ServiceProcess
    frontend: ServiceProcess
    engine_metrics: int
    frontend_metrics: int

    def scrape(self, port: int) -> Samples:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return parse(reply.read().decode())

    def generate(self, prompt: list[int], max_tokens: int, **params: object) -> list[int]:
        request = frontend_pb2.GenerateRequest(
            prompt_token_ids=frontend_pb2.TokenIds(token_ids=prompt),
            sampling_params=common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, output_kind=common_pb2.OUTPUT_KIND_DELTA,
                **params,  # type: ignore[arg-type]
            ),
        )
        with grpc.insecure_channel(self.frontend.address) as channel:
            responses = list(frontend_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
        return [t for r in responses for t in r.outputs[0].token_ids]


@pytest.fixture(scope="module")
def metered(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeteredStack]:
    log_dir: Path = tmp_path_factory.mktemp("metrics_logs")
    engine_port, frontend_port = free_port(), free_port()
    engine = start_engine(tiny_llama_dir, 0, log_dir, metrics_port=engine_port)
    frontend = start_frontend(tiny_llama_dir, [engine.address], log_dir, metrics_port=frontend_port)
    try:
        engine.wait_serving(START_TIMEOUT)
        frontend.wait_serving(START_TIMEOUT)
        yield MeteredStack(engine, frontend, engine_port, frontend_port)
    finally:
        frontend.stop()
        engine.stop()


def _eventually(check: Callable[[], None], timeout: float = 30.0) -> None:
    """Services record a request's metrics just after its last output goes out: retry."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_counters_and_histograms_move_by_what_the_requests_did(metered: MeteredStack) -> None:
    engine_before = metered.scrape(metered.engine_metrics)
    front_before = metered.scrape(metered.frontend_metrics)

    long_prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 to share
    short_prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # shorter than a block: never cached
    outputs = [
        metered.generate(long_prompt, 4, ignore_eos=True),
        metered.generate(long_prompt, 3, ignore_eos=True),  # hits the first one's 32 tokens
        metered.generate(short_prompt, 5, ignore_eos=True),
    ]
    first = outputs[-1][0]
    # Greedy again, stopping at the first token it produced the last time.
    outputs.append(metered.generate(short_prompt, 5, stop_token_ids=[first]))
    assert [len(o) for o in outputs] == [4, 3, 5, 1]
    prompts = [40, 40, 9, 9]
    num_requests = len(outputs)
    itl_samples = sum(len(o) - 1 for o in outputs)

    def front_moved() -> None:
        after = metered.scrape(metered.frontend_metrics)

        def delta(name: str, **labels: str) -> float:
            return value(after, name, **labels) - value(front_before, name, **labels)

        assert delta("tandem:request_success_total", finished_reason="length") == 3
        assert delta("tandem:request_success_total", finished_reason="stop") == 1
        assert delta("tandem:request_success_total", finished_reason="abort") == 0
        assert delta("tandem:prompt_tokens_total") == sum(prompts)
        assert delta("tandem:generation_tokens_total") == sum(len(o) for o in outputs)
        assert delta("tandem:time_to_first_token_seconds_count") == num_requests
        assert delta("tandem:e2e_request_latency_seconds_count") == num_requests
        assert delta("tandem:inter_token_latency_seconds_count") == itl_samples
        assert delta("tandem:e2e_request_latency_seconds_sum") >= delta("tandem:time_to_first_token_seconds_sum") > 0
        assert value(after, "tandem:engine_healthy", engine="0", address=metered.engine.address) == 1

    def engine_moved() -> None:
        after = metered.scrape(metered.engine_metrics)

        def delta(name: str) -> float:
            return value(after, name, engine="0") - value(engine_before, name, engine="0")

        for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
            assert delta(f"tandem:request_{name}_seconds_count") == num_requests, name
        assert delta("tandem:prefix_cache_queries_total") == sum(prompts)
        assert delta("tandem:prefix_cache_hits_total") == 32
        assert delta("tandem:num_preemptions_total") == 0
        assert value(after, "tandem:num_requests_running", engine="0") == 0
        assert value(after, "tandem:num_requests_waiting", engine="0") == 0
        assert 0 < value(after, "tandem:prefix_cache_hit_rate", engine="0") < 1

    _eventually(front_moved)
    _eventually(engine_moved)


def test_every_metric_is_documented(metered: MeteredStack) -> None:
    page = Path(__file__).resolve().parent.parent / "docs" / "metrics-and-tracing.md"
    readme = page.read_text()
    for port in (metered.engine_metrics, metered.frontend_metrics):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            families = text_string_to_metric_families(reply.read().decode())
            names = {
                f.name for f in families
                if f.name.startswith("tandem:") and not f.name.endswith("_created")  # client's own series
            }
        assert names
        for name in names:
            assert f"`{name}" in readme, f"{name} is not in docs/metrics-and-tracing.md"
