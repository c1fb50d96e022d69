"""The chaos scenarios, run against a ``ChaosStack``; each returns figures, asserts nothing.

- ``fuzz``: hypothesis-drawn requests and raw random bodies to every public method
  and to the engines' Stream / GetEngineInfo; counts answers per status code.
- ``cancels``: streams cancelled mid-generation; what the engines still hold after.
- ``engine_kill``: one engine SIGKILLed under load; how its streams end (with request
  migration: completed on the other engine) and how long each stream waited from the
  kill to its next token, whether a restarted engine is used.
- ``soak``: many ordinary requests; each process' RSS before and after.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from benchmarks.chaos import strategies
from benchmarks.chaos.procs import ChaosStack
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

OK = grpc.StatusCode.OK
# Every answer to fuzzed input must be one of these; never INTERNAL or UNKNOWN.
ALLOWED_CODES = frozenset({
    OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # body over the message size limit, or overload
    grpc.StatusCode.DEADLINE_EXCEEDED,  # the fuzzer's own per-call deadline
    grpc.StatusCode.UNAUTHENTICATED,  # an engine that requires a frontend token
    grpc.StatusCode.PERMISSION_DENIED,
})
GENERATION = "/tandem.v1.Generation/"
ENGINE = "/tandem.v1.EngineCore/"
RAW_FRONTEND_METHODS = ("Generate", "Tokenize", "Detokenize")
CHUNK = 200  # examples drawn at a time (huge ones are MiBs each)


@dataclass
class FuzzResult:
    counts: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    bad: list[str] = field(default_factory=list)  # answers outside ALLOWED_CODES, described
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_code(self) -> collections.Counter[str]:
        out: collections.Counter[str] = collections.Counter()
        for (_, code), count in self.counts.items():
            out[code] += count
        return out


async def _bounded(jobs: list[Callable[[], Awaitable[None]]], concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Callable[[], Awaitable[None]]) -> None:
        async with gate:
            await job()

    await asyncio.gather(*(one(j) for j in jobs))


async def _one_body(body: bytes) -> AsyncIterator[bytes]:
    yield body


async def fuzz(
    stack: ChaosStack, n: int, seed: int, concurrency: int = 8, call_timeout: float = 30.0
) -> FuzzResult:
    """``n`` calls: 60% hypothesis GenerateRequests, 10% TokenizeRequests, 5%
    DetokenizeRequests, 25% raw random bodies (frontend methods and engine RPCs)."""
    result = FuzzResult()
    started = time.monotonic()
    typed = [(0.60, "Generate", strategies.generate_requests()),
             (0.10, "Tokenize", strategies.tokenize_requests()),
             (0.05, "Detokenize", strategies.detokenize_requests())]
    async with grpc.aio.insecure_channel(stack.address) as front:
        engines = [grpc.aio.insecure_channel(e.address) for e in stack.engines]

        async def call(target: grpc.aio.Channel, method: str, body: Any, described: str) -> None:
            streaming = method in (GENERATION + "Generate", ENGINE + "Stream")
            serialize = None if isinstance(body, bytes) else type(body).SerializeToString
            try:
                if method == ENGINE + "Stream":
                    async for _ in target.stream_stream(method)(_one_body(body), timeout=call_timeout):
                        pass
                elif streaming:
                    stream = target.unary_stream(method, request_serializer=serialize)
                    async for _ in stream(body, timeout=call_timeout):
                        pass
                else:
                    await target.unary_unary(method, request_serializer=serialize)(body, timeout=call_timeout)
                code, details = OK, ""
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or ""
            result.counts[(method.rsplit("/", 1)[1], code.name)] += 1
            if code not in ALLOWED_CODES:
                result.bad.append(f"{method} {code.name} {details[:200]!r} for {described[:300]}")

        for share, method, strategy in typed:
            count = int(n * share)
            for start in range(0, count, CHUNK):
                examples = strategies.collect(strategy, min(CHUNK, count - start), seed + start)
                await _bounded(
                    [lambda m=m, path=GENERATION + method: call(front, path, m, repr(m)) for m in examples],
                    concurrency,
                )
        raw_jobs = []
        for i, body in enumerate(strategies.random_bodies(n - result.total, seed)):
            if i % 5 < 3:
                target, method = front, GENERATION + RAW_FRONTEND_METHODS[i % 3]
            else:
                target = engines[i % len(engines)]
                method = ENGINE + ("Stream" if i % 5 == 3 else "GetEngineInfo")
            raw_jobs.append(lambda t=target, m=method, b=body: call(t, m, b, f"raw {b[:40]!r}"))
        await _bounded(raw_jobs, concurrency)
        for channel in engines:
            await channel.close()
    result.seconds = time.monotonic() - started
    return result


def long_request(max_tokens: int, prompt: str = "Tell me a long story") -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(
        prompt=prompt,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def normal_request_completes(stack: ChaosStack, max_tokens: int = 8, timeout: float = 60.0) -> bool:
    async with grpc.aio.insecure_channel(stack.address) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)
        responses = [r async for r in stub.Generate(long_request(max_tokens, "Hello"), timeout=timeout)]
        return bool(responses) and responses[-1].finished and responses[-1].outputs[0].finish_reason == "length"


@dataclass
class CancelResult:
    cancelled: int
    other_endings: collections.Counter[str]  # streams that ended before the cancel
    leftover: list[tuple[int, int, int]]  # per engine (running, waiting, blocks in use)
    seconds: float


async def cancels(
    stack: ChaosStack, n: int, seed: int, concurrency: int = 16, max_tokens: int = 400, settle: float = 30.0
) -> CancelResult:
    """``n`` streams, each cancelled after 0-3 responses (0: before any arrives)."""
    rng = random.Random(seed)
    endings: collections.Counter[str] = collections.Counter()
    done = 0
    started = time.monotonic()
    async with grpc.aio.insecure_channel(stack.address) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)

        async def one(after: int) -> None:
            nonlocal done
            call = stub.Generate(long_request(max_tokens, f"Cancel me {rng.random()}"), timeout=120)
            try:
                for _ in range(after):
                    if (await call.read()) is grpc.aio.EOF:
                        endings["finished"] += 1
                        return
                call.cancel()
                done += 1
            except grpc.aio.AioRpcError as exc:
                endings[exc.code().name] += 1

        afters = [rng.randint(0, 3) for _ in range(n)]
        await _bounded([lambda a=a: one(a) for a in afters], concurrency)
    leftover = await asyncio.to_thread(stack.wait_idle, settle)
    return CancelResult(done, endings, leftover, time.monotonic() - started)


@dataclass
class KillResult:
    streams: int
    load_before: list[tuple[int, int, int]]
    endings: collections.Counter[str]  # "completed", or the status code name
    unavailable_after_s: list[float]  # kill -> end of each stream that ended UNAVAILABLE
    resumed_after_s: list[float]  # kill -> next message, per stream that got one (migrated ones wait longest)
    other_failures: list[str]
    restarted_used_after_s: float | None  # restart SERVING -> restarted engine runs a request


async def engine_kill(
    stack: ChaosStack, streams: int = 8, max_tokens: int = 900, victim: int = 0, reuse_timeout: float = 90.0
) -> KillResult:
    """Needs >= 2 engines. SIGKILL ``victim`` while ``streams`` long requests run."""
    endings: collections.Counter[str] = collections.Counter()
    unavailable: list[float] = []
    resumed: list[float] = []
    failures: list[str] = []
    killed_at: list[float] = []
    async with grpc.aio.insecure_channel(stack.address) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)
        calls = [stub.Generate(long_request(max_tokens, f"Story {i}"), timeout=180) for i in range(streams)]
        firsts = await asyncio.gather(*(c.read() for c in calls), return_exceptions=True)
        load_before = await asyncio.to_thread(stack.engine_load)

        async def drain(call: Any, first: Any) -> None:
            last = first
            try:
                if isinstance(first, BaseException):
                    raise first
                # read() only: grpc.aio forbids mixing it with async iteration on one call.
                while (msg := await call.read()) is not grpc.aio.EOF:
                    if last is first and killed_at:
                        resumed.append(time.monotonic() - killed_at[0])
                    last = msg
                if last is not grpc.aio.EOF and last.finished and last.outputs[0].finish_reason == "length":
                    endings["completed"] += 1
                else:
                    failures.append(f"ended without finishing: {last}")
            except grpc.aio.AioRpcError as exc:
                endings[exc.code().name] += 1
                if exc.code() == grpc.StatusCode.UNAVAILABLE and killed_at:
                    unavailable.append(time.monotonic() - killed_at[0])
                else:
                    failures.append(f"{exc.code().name}: {exc.details()}")

        drains = [asyncio.ensure_future(drain(c, f)) for c, f in zip(calls, firsts)]
        killed_at.append(time.monotonic())
        await asyncio.to_thread(stack.engines[victim].kill)  # reaping it takes a while: keep reading
        await asyncio.gather(*drains)

        restarted = stack.restart_engine(victim)  # on this thread: see Service.start
        await asyncio.to_thread(restarted.wait_serving, stack.start_timeout)
        serving_at = time.monotonic()
        used_after = None
        while used_after is None and time.monotonic() - serving_at < reuse_timeout:
            probe = [stub.Generate(long_request(200, f"Again {i}"), timeout=120) for i in range(4)]
            await asyncio.gather(*(c.read() for c in probe), return_exceptions=True)
            info = await asyncio.to_thread(stack.engine_info, victim)
            if info.num_running_reqs + info.num_waiting_reqs > 0:
                used_after = time.monotonic() - serving_at
            for c in probe:
                c.cancel()
            if used_after is None:
                await asyncio.sleep(0.5)
    return KillResult(streams, load_before, endings, unavailable, resumed, failures, used_after)


@dataclass
class SoakResult:
    requests: int
    endings: collections.Counter[str]
    rss_before: dict[str, int]  # after the warm-up
    rss_after: dict[str, int]
    seconds: float
    warmup: int = 0
    rss_start: dict[str, int] = field(default_factory=dict)  # before the warm-up

    def growth(self) -> dict[str, float]:
        return {k: self.rss_after[k] / self.rss_before[k] - 1.0 for k in self.rss_before}


def _soak_request(rng: random.Random) -> frontend_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(max_tokens=rng.randint(1, 16), temperature=rng.choice([0.0, 0.7, 1.0]))
    if rng.random() < 0.2:
        sp.n = 2
    if rng.random() < 0.2:
        sp.logprobs = 2
    if rng.random() < 0.2:
        sp.stop.append("e")
    if rng.random() < 0.5:
        return frontend_pb2.GenerateRequest(prompt=f"Soak {rng.random()} " * rng.randint(1, 20), sampling_params=sp)
    return frontend_pb2.GenerateRequest(
        chat=frontend_pb2.ChatMessages(messages=[frontend_pb2.ChatMessage(role="user", content=f"Hi {rng.random()}")]),
        sampling_params=sp,
    )


# RSS is read this long after the engines go idle: past core_loop.IDLE_RELEASE_S, when an
# idle engine has given its heap's free pages back, so the reading is what it holds.
IDLE_READ_S = 2.0


async def soak(stack: ChaosStack, n: int, seed: int, concurrency: int = 16, warmup: int = 200) -> SoakResult:
    """RSS of every process, ``warmup`` requests, RSS, ``n`` requests, RSS again.

    An engine's RSS rises over its first few thousand requests and then stays level (one
    EngineCore, in-process, measured: +267, +106, +32, +21, +8 MiB per 2,000 requests,
    Python object count flat): oneDNN builds and caches a primitive per new batch row
    count, and glibc keeps its heap's high-water mark (``keep_freed_memory_mapped``). A
    warm-up of that length separates filling caches from growth that goes on."""
    rng = random.Random(seed)
    endings: collections.Counter[str] = collections.Counter()
    async with grpc.aio.insecure_channel(stack.address) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)

        async def one() -> None:
            try:
                async for _ in stub.Generate(_soak_request(rng), timeout=120):
                    pass
                endings["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                endings[exc.code().name] += 1

        start = {s.name: s.rss_bytes() for s in stack.services}
        await _bounded([one for _ in range(warmup)], concurrency)
        await asyncio.to_thread(stack.wait_idle, 30.0)
        await asyncio.sleep(IDLE_READ_S)
        endings.clear()
        before = {s.name: s.rss_bytes() for s in stack.services}
        started = time.monotonic()
        await _bounded([one for _ in range(n)], concurrency)
        seconds = time.monotonic() - started
        await asyncio.to_thread(stack.wait_idle, 30.0)
        await asyncio.sleep(IDLE_READ_S)
        after = {s.name: s.rss_bytes() for s in stack.services}
    return SoakResult(n, endings, before, after, seconds, warmup, start)
