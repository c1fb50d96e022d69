"""Online serving benchmark: a load generator for a running server.

Sends requests to a server with Poisson arrivals (``--request-rate``) or a fixed number in
flight (``--max-concurrency``), streams every response, and reports what a client sees:
time to first token (TTFT), time per output token (TPOT), inter-token latency (ITL),
end-to-end latency (E2E) and throughput.

Two backends measure the same things the same way:

* ``tandem``: the public gRPC API (``tandem.v1.Generation/Generate``, delta outputs).
* ``openai``: an OpenAI-compatible ``/v1/completions`` streaming endpoint (``vllm serve``),
  spoken with a small HTTP/1.1 + server-sent-events client on asyncio streams.

Every prompt is a list of token ids, every request asks for exactly its output length
(``ignore_eos``, greedy). Examples::

    python -m benchmarks.serve_bench --launch --model DIR --num-requests 200 \\
        --workload mixed --request-rates 1,2,4,inf --json out.json --plot-dir plots \\
        -- --max-model-len 2048
    python -m benchmarks.serve_bench --target 127.0.0.1:50051 --model DIR --request-rate 4
    python -m benchmarks.serve_bench --backend openai --base-url http://127.0.0.1:8000 \\
        --model DIR --served-model-name my-model --max-concurrency 16

Definitions (per request, times from the moment the request is sent):

* TTFT: until the first streamed chunk that carries at least one token.
* E2E: until the stream ends.
* TPOT: ``(E2E - TTFT) / (output_tokens - 1)``; requests with one output token have none.
* ITL: the gap between consecutive token-bearing chunks; a chunk with k tokens counts as
  k gaps of (gap / k), and extra tokens in the first chunk as gaps of 0, so a request has
  ``output_tokens - 1`` ITLs and their mean is close to its TPOT.
* Throughput: completed requests, output tokens and prompt + output tokens over the run's
  duration (first request sent to last response received).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from benchmarks.common import FIRST_ORDINARY_TOKEN, format_table, read_model_config

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
LATENCY_NAMES = {
    "ttft": "TTFT (time to first token)",
    "tpot": "TPOT (time per output token)",
    "itl": "ITL (inter-token latency)",
    "e2e": "E2E (end-to-end latency)",
}


# ---- workloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: a prompt of token ids and how many tokens it must generate."""

    index: int
    kind: str  # "random" or "shared-prefix"
    prompt: list[int]
    max_tokens: int
    prefix_index: int | None = None  # which shared prefix the prompt starts with
    prefix_len: int = 0


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """The closed range ``[mean * (1 - r), mean * (1 + r)]``, at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    if mean < 1:
        raise ValueError(f"lengths must be >= 1, got {mean}")
    lo = max(1, math.floor(mean * (1.0 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1.0 + range_ratio)))
    return lo, hi


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(n)]


def make_requests(
    workload: str,
    num_requests: int,
    vocab_size: int,
    seed: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    num_prefixes: int = 4,
    prefix_len: tuple[int, int] = (500, 1000),
    suffix_len: int = 32,
    shared_fraction: float = 0.5,
) -> list[RequestSpec]:
    """The requests of a workload, deterministic in ``seed``.

    ``random``: prompt lengths uniform in ``length_range(input_len, range_ratio)``.
    ``shared-prefix``: ``num_prefixes`` system prompts (lengths uniform in ``prefix_len``),
    each request one of them (in turn) plus a random suffix of ``length_range(suffix_len,
    range_ratio)`` tokens. ``mixed``: ``shared_fraction`` of the requests shared-prefix,
    the rest random, in shuffled order. Output lengths: ``length_range(output_len,
    range_ratio)`` for all.
    """
    if workload not in ("random", "shared-prefix", "mixed"):
        raise ValueError(f"unknown workload {workload!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if vocab_size <= FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary tokens")
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    if not 1 <= prefix_len[0] <= prefix_len[1]:
        raise ValueError(f"prefix lengths must satisfy 1 <= min <= max, got {prefix_len}")
    if not 0.0 <= shared_fraction <= 1.0:
        raise ValueError(f"shared_fraction must be in [0, 1], got {shared_fraction}")
    rng = random.Random(seed)
    in_range = length_range(input_len, range_ratio)
    out_range = length_range(output_len, range_ratio)
    suffix_range = length_range(suffix_len, range_ratio)
    if workload == "random":
        kinds = ["random"] * num_requests
    elif workload == "shared-prefix":
        kinds = ["shared-prefix"] * num_requests
    else:
        num_shared = round(num_requests * shared_fraction)
        kinds = ["shared-prefix"] * num_shared + ["random"] * (num_requests - num_shared)
        rng.shuffle(kinds)
    prefixes = []
    if "shared-prefix" in kinds:
        prefixes = [
            random_tokens(rng, rng.randint(*prefix_len), vocab_size) for _ in range(num_prefixes)
        ]
    specs = []
    num_shared_so_far = 0
    for i, kind in enumerate(kinds):
        max_tokens = rng.randint(*out_range)
        if kind == "random":
            prompt = random_tokens(rng, rng.randint(*in_range), vocab_size)
            specs.append(RequestSpec(i, kind, prompt, max_tokens))
        else:
            p = num_shared_so_far % num_prefixes
            num_shared_so_far += 1
            suffix = random_tokens(rng, rng.randint(*suffix_range), vocab_size)
            specs.append(
                RequestSpec(i, kind, prefixes[p] + suffix, max_tokens, p, len(prefixes[p]))
            )
    return specs


def arrival_times(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process at ``request_rate`` requests
    per second (exponential gaps, the first request at 0), or all 0 for ``inf``."""
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals-{seed}")
    times, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(request_rate)
        times.append(t)
    return times


# ---- metric math -----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int]:
    """count, mean, p50 (= median), p90, p99, min, max and std of ``values * scale``."""
    scaled = [v * scale for v in values]
    if not scaled:
        nan = math.nan
        return {"count": 0, "mean": nan, "median": nan, "p50": nan, "p90": nan, "p99": nan,
                "min": nan, "max": nan, "std": nan}
    mean = sum(scaled) / len(scaled)
    out: dict[str, float | int] = {"count": len(scaled), "mean": mean}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(scaled, q)
    out["median"] = out["p50"]
    out["min"], out["max"] = min(scaled), max(scaled)
    out["std"] = math.sqrt(sum((v - mean) ** 2 for v in scaled) / len(scaled))
    return out


def time_per_output_token(ttft: float, e2e: float, output_tokens: int) -> float | None:
    """``(e2e - ttft) / (output_tokens - 1)``; None with fewer than two output tokens."""
    if output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """ITLs of one request from its token-bearing chunks (arrival times, token counts).

    The first chunk's first token is the TTFT; its other tokens arrived with it (gaps of
    0). A later chunk with k tokens that arrived ``gap`` after the previous chunk gives k
    ITLs of ``gap / k``. So there are ``sum(chunk_tokens) - 1`` of them and they add up
    to ``chunk_times[-1] - chunk_times[0]``.
    """
    if len(chunk_times) != len(chunk_tokens):
        raise ValueError("chunk_times and chunk_tokens differ in length")
    if not chunk_times:
        return []
    if any(k < 1 for k in chunk_tokens):
        raise ValueError("every chunk must carry at least one token")
    itls = [0.0] * (chunk_tokens[0] - 1)
    for i in range(1, len(chunk_times)):
        k = chunk_tokens[i]
        itls.extend([(chunk_times[i] - chunk_times[i - 1]) / k] * k)
    return itls


# ---- per-request records -----------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What happened to one request. Times in seconds; ``send_time`` from the run's start,
    the others from the moment the request was sent."""

    index: int
    kind: str
    prompt_tokens: int
    max_tokens: int
    prefix_index: int | None = None
    success: bool = False
    status: str = ""  # "OK", a gRPC status code name, "HTTP <code>", "TIMEOUT", ...
    error: str = ""
    send_time: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens the server served from its prefix cache
    finish_reason: str = ""
    chunk_times: list[float] = field(default_factory=list)  # token-bearing chunks only
    chunk_tokens: list[int] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def add_chunk(self, at: float, tokens: int) -> None:
        if tokens <= 0:
            return
        if self.ttft is None:
            self.ttft = at
        self.chunk_times.append(at)
        self.chunk_tokens.append(tokens)

    def finish(self, e2e: float, reported_output_tokens: int | None) -> None:
        """Close a stream that ended normally: derive TPOT and ITLs, check for output."""
        self.e2e = e2e
        streamed = sum(self.chunk_tokens)
        self.output_tokens = reported_output_tokens or streamed
        if self.ttft is None:
            self.fail("NO_OUTPUT", "the stream ended without any output token")
            return
        self.itl = inter_token_latencies(self.chunk_times, self.chunk_tokens)
        self.tpot = time_per_output_token(self.ttft, e2e, self.output_tokens)
        if self.finish_reason in ("abort", "error"):
            self.fail(self.finish_reason.upper(), f"finish_reason {self.finish_reason!r}")
            return
        self.success, self.status = True, "OK"

    def fail(self, status: str, error: str) -> None:
        self.success, self.status, self.error = False, status, error[:500]


def new_record(spec: RequestSpec) -> RequestRecord:
    return RequestRecord(spec.index, spec.kind, len(spec.prompt), spec.max_tokens, spec.prefix_index)


# ---- backends --------------------------------------------------------------------------------


class Backend:
    name = ""

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def send(self, spec: RequestSpec, timeout: float) -> RequestRecord:
        """Send one request, stream its response; never raises for server errors."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class TandemBackend(Backend):
    """``tandem.v1.Generation/Generate`` over one gRPC channel (HTTP/2 streams)."""

    name = "tandem"

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel: Any = None
        self.stub: Any = None

    def describe(self) -> str:
        return f"tandem gRPC {self.target}"

    async def start(self) -> None:
        import grpc

        from tandem.v1 import frontend_pb2_grpc

        self.channel = grpc.aio.insecure_channel(
            self.target, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        )
        self.stub = frontend_pb2_grpc.GenerationStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None

    async def model_info(self, timeout: float = 30.0) -> Any:
        from tandem.v1 import frontend_pb2

        return await self.stub.GetModelInfo(frontend_pb2.GetModelInfoRequest(), timeout=timeout)

    async def send(self, spec: RequestSpec, timeout: float) -> RequestRecord:
        import grpc

        from tandem.v1 import common_pb2, frontend_pb2

        record = new_record(spec)
        request = frontend_pb2.GenerateRequest(
            prompt_token_ids=frontend_pb2.TokenIds(token_ids=spec.prompt),
            sampling_params=common_pb2.SamplingParams(
                max_tokens=spec.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                output_kind=common_pb2.OUTPUT_KIND_DELTA,
            ),
        )
        start = time.perf_counter()
        usage_tokens = None
        call = self.stub.Generate(request, timeout=timeout)
        try:
            async for response in call:
                now = time.perf_counter() - start
                record.add_chunk(now, sum(len(out.token_ids) for out in response.outputs))
                for out in response.outputs:
                    if out.finish_reason:
                        record.finish_reason = out.finish_reason
                if response.HasField("usage"):
                    usage_tokens = response.usage.completion_tokens
                    record.cached_tokens = response.usage.cached_tokens
        except grpc.aio.AioRpcError as exc:
            record.e2e = time.perf_counter() - start
            record.fail(exc.code().name, exc.details() or "")
            return record
        except asyncio.CancelledError:
            call.cancel()
            raise
        record.finish(time.perf_counter() - start, usage_tokens)
        return record


# -- OpenAI-compatible HTTP: a small HTTP/1.1 client and an SSE parser on asyncio streams --


class HTTPError(Exception):
    pass


@dataclass
class HTTPResponse:
    status: int
    reason: str
    headers: dict[str, str]  # lower-case names
    reader: asyncio.StreamReader

    async def iter_body(self, read_size: int = 65536) -> AsyncIterator[bytes]:
        """The body, de-chunked, as it arrives."""
        encoding = self.headers.get("transfer-encoding", "").lower()
        if "chunked" in encoding:
            while True:
                size_line = await self.reader.readline()
                if not size_line.endswith(b"\n"):
                    raise HTTPError("connection closed inside a chunked body")
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError as exc:
                    raise HTTPError(f"bad chunk size line {size_line!r}") from exc
                if size == 0:
                    while (await self.reader.readline()).strip():  # trailers
                        pass
                    return
                data = await self.reader.readexactly(size)
                await self.reader.readexactly(2)  # CRLF after the chunk
                yield data
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            while remaining > 0:
                data = await self.reader.read(min(read_size, remaining))
                if not data:
                    raise HTTPError("connection closed before the end of the body")
                remaining -= len(data)
                yield data
        else:  # until the server closes the connection
            while data := await self.reader.read(read_size):
                yield data

    async def read_body(self) -> bytes:
        return b"".join([part async for part in self.iter_body()])


async def read_response_head(reader: asyncio.StreamReader) -> HTTPResponse:
    """Parse the status line and headers of an HTTP/1.x response."""
    status_line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise HTTPError(f"bad status line {status_line!r}")
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if not line:
            raise HTTPError("connection closed inside the response headers")
        text = line.decode("latin-1").rstrip("\r\n")
        if not text:
            break
        name, _, value = text.partition(":")
        headers[name.strip().lower()] = value.strip()
    return HTTPResponse(int(parts[1]), parts[2] if len(parts) > 2 else "", headers, reader)


@contextlib.asynccontextmanager
async def http_post(
    url: str, body: bytes, headers: dict[str, str] | None = None
) -> AsyncIterator[HTTPResponse]:
    """POST ``body`` to ``url`` on a fresh connection; yields the response (head read)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"unsupported URL scheme in {url!r}")
    tls = parts.scheme == "https"
    host = parts.hostname or "localhost"
    port = parts.port or (443 if tls else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    reader, writer = await asyncio.open_connection(
        host, port, ssl=ssl.create_default_context() if tls else None
    )
    try:
        head = {
            "Host": parts.netloc,
            "Content-Type": "application/json",
            "Content-Length": str(len(body)),
            "Accept": "text/event-stream",
            "Connection": "close",
            "User-Agent": "tandem-serve-bench",
            **(headers or {}),
        }
        request = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
        writer.write(request.encode("latin-1") + b"\r\n" + body)
        await writer.drain()
        yield await read_response_head(reader)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


class SSEParser:
    """Incremental server-sent-events parser: ``feed`` bytes, get the data of every event
    completed so far (multi-line data joined with newlines; comments and other fields
    ignored). Lines may end with LF, CRLF or CR and may be split anywhere."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        data = self._buffer + chunk
        hold = b""
        if data.endswith(b"\r"):  # maybe the first half of a CRLF: wait for the next byte
            data, hold = data[:-1], b"\r"
        lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self._buffer = lines.pop() + hold  # the unfinished last line
        events = []
        for raw in lines:
            line = raw.decode("utf-8", errors="replace")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif not line.startswith(":"):  # ":" starts a comment
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def close(self) -> list[str]:
        """Events left when the stream ends without a final blank line."""
        events = self.feed(b"\n\n") if self._buffer else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events


@dataclass
class CompletionChunk:
    """What one streamed /v1/completions event says."""

    done: bool = False  # "[DONE]"
    text: str = ""
    tokens: int = 0  # tokens in this chunk: len(token_ids) if sent, else 1 if text is not empty
    finish_reason: str = ""
    completion_tokens: int | None = None  # from the usage chunk
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str = ""


def parse_completion_event(data: str) -> CompletionChunk:
    """Interpret the data of one SSE event of an OpenAI-style completions stream."""
    if data.strip() == "[DONE]":
        return CompletionChunk(done=True)
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        return CompletionChunk(error=f"bad JSON in stream: {data[:200]!r}")
    if not isinstance(obj, dict):
        return CompletionChunk(error=f"unexpected event: {data[:200]!r}")
    chunk = CompletionChunk()
    if obj.get("error"):
        err = obj["error"]
        chunk.error = str(err.get("message", err) if isinstance(err, dict) else err)
        return chunk
    for choice in obj.get("choices") or []:
        text = choice.get("text") or ""
        chunk.text += text
        token_ids = choice.get("token_ids")
        if isinstance(token_ids, list):
            chunk.tokens += len(token_ids)
        elif text:
            chunk.tokens += 1
        if choice.get("finish_reason"):
            chunk.finish_reason = str(choice["finish_reason"])
    usage = obj.get("usage")
    if isinstance(usage, dict):
        chunk.completion_tokens = usage.get("completion_tokens")
        chunk.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            chunk.cached_tokens = int(details["cached_tokens"])
    return chunk


class OpenAIBackend(Backend):
    """POST ``{base_url}{endpoint}`` with ``stream: true``; one connection per request."""

    name = "openai"

    def __init__(self, base_url: str, model: str, endpoint: str = "/v1/completions",
                 extra_body: dict[str, Any] | None = None) -> None:
        self.url = base_url.rstrip("/") + endpoint
        self.model = model
        self.extra_body = extra_body or {}
        self.headers = {}
        if key := os.environ.get("OPENAI_API_KEY"):
            self.headers["Authorization"] = f"Bearer {key}"

    def describe(self) -> str:
        return f"openai {self.url} (model {self.model})"

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }

    async def send(self, spec: RequestSpec, timeout: float) -> RequestRecord:
        record = new_record(spec)
        body = json.dumps(self.payload(spec)).encode()
        start = time.perf_counter()
        try:
            async with asyncio.timeout(timeout), http_post(self.url, body, self.headers) as response:
                if response.status != 200:
                    text = (await response.read_body()).decode("utf-8", errors="replace")
                    record.e2e = time.perf_counter() - start
                    record.fail(f"HTTP {response.status}", text or response.reason)
                    return record
                usage_tokens = await consume_completion_stream(
                    response.iter_body(), record, start
                )
        except TimeoutError:
            record.e2e = time.perf_counter() - start
            record.fail("TIMEOUT", f"no complete response within {timeout:g}s")
            return record
        except (OSError, HTTPError, asyncio.IncompleteReadError) as exc:
            record.e2e = time.perf_counter() - start
            record.fail(type(exc).__name__, str(exc))
            return record
        if record.status:  # the stream reported an error
            return record
        record.finish(time.perf_counter() - start, usage_tokens)
        return record


async def consume_completion_stream(
    body: AsyncIterator[bytes], record: RequestRecord, start: float
) -> int | None:
    """Read an SSE completions stream into ``record``; returns the reported completion
    tokens (None if the server sent no usage). Marks ``record`` failed on an error event."""
    parser = SSEParser()
    usage_tokens = None

    def handle(events: Iterable[str]) -> bool:
        nonlocal usage_tokens
        now = time.perf_counter() - start
        for data in events:
            chunk = parse_completion_event(data)
            if chunk.error:
                record.e2e = now
                record.fail("STREAM_ERROR", chunk.error)
                return True
            if chunk.done:
                return True
            record.add_chunk(now, chunk.tokens)
            if chunk.finish_reason:
                record.finish_reason = chunk.finish_reason
            if chunk.completion_tokens is not None:
                usage_tokens = chunk.completion_tokens
            if chunk.cached_tokens is not None:
                record.cached_tokens = chunk.cached_tokens
        return False

    async for part in body:
        if handle(parser.feed(part)):
            return usage_tokens
    handle(parser.close())
    return usage_tokens


# ---- running ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    request_rate: float
    max_concurrency: int | None
    seed: int
    duration: float
    records: list[RequestRecord]
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        conc = f", max concurrency {self.max_concurrency}" if self.max_concurrency else ""
        return f"rate {rate}/s{conc}"


async def run_load(
    backend: Backend,
    specs: Sequence[RequestSpec],
    request_rate: float,
    max_concurrency: int | None,
    timeout: float,
    seed: int,
    progress: bool,
    desc: str = "",
) -> RunResult:
    """Send ``specs`` at their Poisson arrival times (at most ``max_concurrency`` in
    flight) and wait for all of them; every request ends within ``timeout`` seconds."""
    times = arrival_times(len(specs), request_rate, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = make_progress_bar(len(specs), desc) if progress else None
    start = time.perf_counter()

    async def one(spec: RequestSpec) -> RequestRecord:
        async with semaphore or contextlib.nullcontext():
            sent = time.perf_counter()
            try:
                # The backend passes the deadline to the server too; this bound also
                # covers connecting and a server that stops answering.
                record = await asyncio.wait_for(backend.send(spec, timeout), timeout + 5.0)
            except TimeoutError:
                record = new_record(spec)
                record.e2e = time.perf_counter() - sent
                record.fail("TIMEOUT", f"no complete response within {timeout:g}s")
            except Exception as exc:  # a client bug must not lose the other requests
                record = new_record(spec)
                record.e2e = time.perf_counter() - sent
                record.fail(type(exc).__name__, repr(exc))
            record.send_time = sent - start
        if bar is not None:
            bar.update(1)
        return record

    tasks = []
    for spec, at in zip(specs, times):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec)))
    try:
        records = list(await asyncio.gather(*tasks))
    finally:
        if bar is not None:
            bar.close()
    duration = time.perf_counter() - start
    result = RunResult(request_rate, max_concurrency, seed, duration, records)
    result.summary = summarize(records, duration)
    return result


def make_progress_bar(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc or "requests", unit="req", file=sys.stderr)


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """The run's metrics: counts, throughput, and latency distributions in ms."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "failed_by_status": dict(Counter(r.status for r in failed)),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "prefix_cache_hit_rate": (
            sum(cached) / sum(r.prompt_tokens for r in ok if r.cached_tokens is not None)
            if cached else None
        ),
    }
    series = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2e": [r.e2e for r in ok if r.e2e is not None],
    }
    for name in LATENCY_METRICS:
        summary[f"{name}_ms"] = distribution(series[name], scale=1000.0)
    return summary


def format_summary(result: RunResult, backend: Backend, workload: str) -> str:
    s = result.summary
    fails = ", ".join(f"{k}: {v}" for k, v in sorted(s["failed_by_status"].items()))
    lines = [
        f"== serving benchmark: {backend.describe()}, workload {workload}, {result.label} ==",
        f"completed requests:          {s['completed']} / {s['num_requests']}",
        f"failed requests:             {s['failed']}" + (f" ({fails})" if fails else ""),
        f"duration (s):                {s['duration_s']:.2f}",
        f"input / output tokens:       {s['total_input_tokens']} / {s['total_output_tokens']}",
        f"request throughput (req/s):  {s['request_throughput']:.2f}",
        f"output throughput (tok/s):   {s['output_throughput']:.2f}",
        f"total throughput (tok/s):    {s['total_token_throughput']:.2f}",
    ]
    if s["prefix_cache_hit_rate"] is not None:
        lines.append(
            f"prefix cache hits:           {s['cached_prompt_tokens']} prompt tokens "
            f"({100 * s['prefix_cache_hit_rate']:.1f}%)"
        )
    rows = []
    for name in LATENCY_METRICS:
        d = s[f"{name}_ms"]
        rows.append([name.upper(), d["count"], *(_num(d[k]) for k in ("mean", "p50", "p90", "p99", "max"))])
    lines.append("")
    lines.append(format_table(["latency (ms)", "n", "mean", "p50", "p90", "p99", "max"], rows))
    return "\n".join(lines)


def format_sweep(results: Sequence[RunResult]) -> str:
    rows = []
    for r in results:
        s = r.summary
        rows.append([
            "inf" if math.isinf(r.request_rate) else f"{r.request_rate:g}",
            s["completed"], s["failed"], s["duration_s"], s["request_throughput"],
            s["output_throughput"], _num(s["ttft_ms"]["mean"]), _num(s["ttft_ms"]["p99"]),
            _num(s["tpot_ms"]["mean"]), _num(s["itl_ms"]["p99"]), _num(s["e2e_ms"]["mean"]),
        ])
    headers = ["rate", "ok", "failed", "dur s", "req/s", "out tok/s", "TTFT mean",
               "TTFT p99", "TPOT mean", "ITL p99", "E2E mean"]
    return "== sweep (latencies in ms) ==\n" + format_table(headers, rows)


def _num(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


# ---- plots -----------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(results: Sequence[RunResult], path: str, title: str) -> str:
    """TTFT, ITL and E2E CDFs side by side, one curve per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, name in zip(axes, ("ttft", "itl", "e2e")):
        for result in results:
            ok = [r for r in result.records if r.success]
            if name == "itl":
                values = [x for r in ok for x in r.itl]
            else:
                values = [getattr(r, name) for r in ok if getattr(r, name) is not None]
            values = sorted(v * 1000.0 for v in values)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=result.label)
        ax.set_title(LATENCY_NAMES[name])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of " + ("tokens" if name == "itl" else "requests"))
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if len(results) > 1:
            ax.legend(fontsize="small")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rate_axis(results: Sequence[RunResult]) -> tuple[list[float], list[str]]:
    """x positions for the rates: ``inf`` goes one step past the largest finite rate."""
    finite = [r.request_rate for r in results if not math.isinf(r.request_rate)]
    top = max(finite) if finite else 1.0
    xs = [top * 1.5 if math.isinf(r.request_rate) else r.request_rate for r in results]
    labels = ["inf" if math.isinf(r.request_rate) else f"{r.request_rate:g}" for r in results]
    return xs, labels


def plot_sweep(results: Sequence[RunResult], plot_dir: str, title: str) -> list[str]:
    """Throughput vs request rate and TTFT (mean, p99) vs request rate."""
    plt = _pyplot()
    results = sorted(results, key=lambda r: r.request_rate)
    xs, labels = _rate_axis(results)
    paths = []

    fig, (ax_req, ax_tok) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_req.plot(xs, [r.summary["request_throughput"] for r in results], "o-", label="achieved")
    finite = [(x, r.request_rate) for x, r in zip(xs, results) if not math.isinf(r.request_rate)]
    if finite:
        ax_req.plot([f[0] for f in finite], [f[1] for f in finite], "x--", color="gray",
                    label="offered")
    ax_req.set_ylabel("completed requests / s")
    ax_req.legend()
    ax_tok.plot(xs, [r.summary["output_throughput"] for r in results], "o-", label="output")
    ax_tok.plot(xs, [r.summary["total_token_throughput"] for r in results], "s-", label="prompt + output")
    ax_tok.set_ylabel("tokens / s")
    ax_tok.legend()
    for ax in (ax_req, ax_tok):
        ax.set_xlabel("request rate (requests / s)")
        ax.set_xticks(xs, labels)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"throughput vs request rate\n{title}", fontsize=11)
    fig.tight_layout()
    paths.append(os.path.join(plot_dir, "sweep_throughput.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for stat, style in (("mean", "o-"), ("p99", "s--")):
        ys = [_num(r.summary["ttft_ms"][stat]) for r in results]
        ax.plot(xs, [math.nan if y is None else y for y in ys], style, label=f"TTFT {stat}")
    ax.set_xlabel("request rate (requests / s)")
    ax.set_ylabel("ms")
    ax.set_xticks(xs, labels)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"TTFT vs request rate\n{title}", fontsize=10)
    fig.tight_layout()
    paths.append(os.path.join(plot_dir, "sweep_ttft.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


# ---- launching a local stack ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_range(count: int, attempts: int = 50) -> int:
    """A base port such that base .. base + count - 1 are all free right now."""
    for _ in range(attempts):
        base = free_port()
        if base + count > 65535:
            continue
        try:
            for port in range(base + 1, base + count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"found no {count} consecutive free ports")


class LaunchedStack:
    """``tandem serve`` as a child process group, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(
        self, model: str, engines: int, engine_args: Sequence[str], log_path: str,
        serve_args: Sequence[str] = (), preexec_fn: Any = None,
    ) -> None:
        """``serve_args``: more ``tandem serve`` flags (e.g. ``--prefill-engines 1
        --decode-engines 1``, which then decide the number of engines); ``preexec_fn``:
        run in the child before ``tandem serve`` starts (e.g. joining a cgroup)."""
        # One range of free ports for everything serve opens: the frontend (base), its
        # admin listener (serve's default: the frontend's port + 1), the HTTP API and the
        # engines. Ports picked one by one could land on each other's +1.
        base = free_port_range(engines + 3)
        self.port, self.http_port = base, base + 2
        self.engine_addresses = [f"127.0.0.1:{base + 3 + i}" for i in range(engines)]
        self.target = f"127.0.0.1:{self.port}"
        self.base_url = f"http://127.0.0.1:{self.http_port}"  # the OpenAI-compatible API
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", model,
               "--engines", str(engines), "--port", str(self.port), "--http-port", str(self.http_port),
               "--engine-base-port", str(base + 3), *serve_args, "--", *engine_args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,  # its own process group: engines included
            preexec_fn=preexec_fn,
        )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def wait_serving(self, timeout: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"tandem serve exited with {self.proc.returncode} before SERVING:\n"
                        f"{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tandem serve on {self.target} not SERVING after {timeout:.0f}s:\n"
                        f"{self.log_tail()}"
                    )
                time.sleep(0.25)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # `tandem serve` stops its engines itself
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        # The engines are in the same process group: none may outlive the frontend (it
        # cannot stop them when it dies before its signal handlers are installed).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log.close()


# ---- command line ------------------------------------------------------------------------------


def parse_rate(text: str) -> float:
    value = float(text)  # accepts "inf"
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0, got {text}")
    return value


def parse_rates(text: str) -> list[float]:
    return [parse_rate(t.strip()) for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve_bench",
        description=__doc__.split("\n\n")[0],
        epilog="Engine flags for --launch go after '--', e.g. -- --max-model-len 2048.",
    )
    g = p.add_argument_group("server")
    g.add_argument("--backend", choices=("tandem", "openai"), default="tandem")
    g.add_argument("--target", default="127.0.0.1:50051", help="tandem: frontend HOST:PORT.")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="openai: server URL.")
    g.add_argument("--endpoint", default="/v1/completions", help="openai: completions path.")
    g.add_argument("--served-model-name", default=None,
                   help="openai: the request's model field; default: --model.")
    g.add_argument("--extra-body", default=None,
                   help='openai: JSON merged into every request body, e.g. \'{"return_token_ids": true}\'.')
    g.add_argument("--model", default=None,
                   help="Checkpoint dir: vocab size from its config.json; served by --launch.")
    g.add_argument("--launch", action="store_true",
                   help="Start `tandem serve --model MODEL` on free ports, run, stop it.")
    g.add_argument("--engines", type=int, default=1, help="--launch: number of engines.")
    g.add_argument("--launch-timeout", type=float, default=300.0,
                   help="--launch: seconds to wait for SERVING.")
    g.add_argument("--launch-log", default=None, help="--launch: server log file (default: a temp file).")

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("random", "shared-prefix", "mixed"), default="random")
    g.add_argument("--num-requests", type=int, default=200)
    g.add_argument("--input-len", type=int, default=1024, help="random: mean prompt length.")
    g.add_argument("--output-len", type=int, default=128, help="Mean output length.")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="Lengths uniform in [len * (1 - r), len * (1 + r)].")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts.")
    g.add_argument("--prefix-len-min", type=int, default=500)
    g.add_argument("--prefix-len-max", type=int, default=1000)
    g.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: mean suffix length.")
    g.add_argument("--shared-fraction", type=float, default=0.5,
                   help="mixed: fraction of shared-prefix requests.")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="Token ids are drawn below this; default: --model's config, or the server's.")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=parse_rate, default=math.inf,
                   help="Poisson arrivals per second; inf sends all at once (default).")
    g.add_argument("--request-rates", type=parse_rates, default=None,
                   help="Sweep: comma-separated rates, one run each (fresh prompts per run).")
    g.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight.")
    g.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout (s).")
    g.add_argument("--warmup-requests", type=int, default=1,
                   help="Unmeasured random requests sent first (not sharing any prefix).")

    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="Write per-request records and summaries here.")
    g.add_argument("--plot-dir", default=None, help="Write PNG plots here.")
    g.add_argument("--no-progress", action="store_true", help="No progress bar.")
    return p


def split_engine_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def resolve_vocab_size(args: argparse.Namespace) -> int | None:
    if args.vocab_size:
        return args.vocab_size
    if args.model and os.path.isfile(os.path.join(args.model, "config.json")):
        return int(read_model_config(args.model)["vocab_size"])
    return None


async def run_benchmark(args: argparse.Namespace, backend: Backend) -> list[RunResult]:
    await backend.start()
    try:
        vocab_size = resolve_vocab_size(args)
        max_model_len = None
        if isinstance(backend, TandemBackend):
            import grpc

            try:
                info = await backend.model_info()
            except grpc.aio.AioRpcError as exc:
                raise SystemExit(
                    f"error: GetModelInfo on {backend.target} failed: "
                    f"{exc.code().name}: {exc.details()}"
                ) from None
            vocab_size = vocab_size or info.vocab_size
            max_model_len = info.max_model_len
        if not vocab_size:
            raise SystemExit("give --vocab-size or --model DIR (with config.json)")
        rates = args.request_rates or [args.request_rate]

        def workload(seed: int) -> list[RequestSpec]:
            return make_requests(
                args.workload, args.num_requests, vocab_size, seed,
                input_len=args.input_len, output_len=args.output_len,
                range_ratio=args.range_ratio, num_prefixes=args.num_prefixes,
                prefix_len=(args.prefix_len_min, args.prefix_len_max),
                suffix_len=args.suffix_len, shared_fraction=args.shared_fraction,
            )

        if args.warmup_requests > 0:
            rng = random.Random(f"warmup-{args.seed}")
            warm = [RequestSpec(i, "warmup", random_tokens(rng, min(args.input_len, 64), vocab_size),
                                min(args.output_len, 8)) for i in range(args.warmup_requests)]
            res = await run_load(backend, warm, math.inf, args.max_concurrency, args.timeout,
                                 args.seed, progress=False)
            if res.summary["failed"]:
                bad = next(r for r in res.records if not r.success)
                print(f"warning: warm-up request failed: {bad.status}: {bad.error}", file=sys.stderr)

        results = []
        for i, rate in enumerate(rates):
            # Each sweep point gets its own prompts, so that no run hits the prefix cache
            # with prompts (or shared prefixes) of an earlier one.
            seed = args.seed + i
            specs = workload(seed)
            longest = max(len(s.prompt) + s.max_tokens for s in specs)
            if max_model_len and longest > max_model_len:
                print(f"warning: the longest request needs {longest} tokens, the server allows "
                      f"{max_model_len}: those requests will fail", file=sys.stderr)
            rate_text = "inf" if math.isinf(rate) else f"{rate:g}"
            result = await run_load(backend, specs, rate, args.max_concurrency, args.timeout,
                                    seed, progress=not args.no_progress, desc=f"rate {rate_text}")
            results.append(result)
            print(format_summary(result, backend, args.workload), flush=True)
            print(flush=True)
        return results
    finally:
        await backend.close()


def write_json(path: str, args: argparse.Namespace, backend: Backend, engine_args: list[str],
               results: Sequence[RunResult]) -> None:
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}
    config["request_rate"] = _rate_json(args.request_rate)
    config["request_rates"] = [_rate_json(r) for r in args.request_rates] if args.request_rates else None
    doc = {
        "backend": backend.name,
        "server": backend.describe(),
        "config": config,
        "engine_args": engine_args,
        "runs": [
            {
                "request_rate": _rate_json(r.request_rate),
                "max_concurrency": r.max_concurrency,
                "seed": r.seed,
                "summary": r.summary,
                "requests": [asdict(rec) for rec in r.records],
            }
            for r in results
        ],
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_finite(doc), f, indent=1)


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _finite(obj: Any) -> Any:
    """NaN/inf floats as null, so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def main(argv: Sequence[str] | None = None) -> int:
    own, engine_args = split_engine_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    if args.num_requests < 1:
        raise SystemExit("--num-requests must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be >= 1")
    if engine_args and not args.launch:
        raise SystemExit("engine flags after '--' need --launch")
    if args.launch and not args.model:
        raise SystemExit("--launch starts `tandem serve`: give --model DIR")

    stack = None
    if args.launch:
        # SIGTERM unwinds like Ctrl-C, so that the launched stack is stopped too.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        log_path = args.launch_log or tempfile.mkstemp(prefix="tandem-serve-", suffix=".log")[1]
        stack = LaunchedStack(args.model, args.engines, engine_args, log_path)
        print(f"launched tandem serve on {stack.target} (log {log_path})", flush=True)
        args.target = stack.target
        args.base_url = stack.base_url  # --backend openai: tandem serve's HTTP API
    try:
        if stack is not None:
            try:
                stack.wait_serving(args.launch_timeout)
            except RuntimeError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        if args.backend == "tandem":
            backend: Backend = TandemBackend(args.target)
        else:
            model_name = args.served_model_name or args.model
            if not model_name:
                raise SystemExit("--backend openai needs --served-model-name or --model")
            extra = json.loads(args.extra_body) if args.extra_body else None
            backend = OpenAIBackend(args.base_url, model_name, args.endpoint, extra)
        results = asyncio.run(run_benchmark(args, backend))
    finally:
        if stack is not None:
            stack.stop()

    if len(results) > 1:
        print(format_sweep(results), flush=True)
    title = f"{backend.describe()}, {args.workload}, {args.num_requests} requests"
    if args.plot_dir:
        os.makedirs(args.plot_dir, exist_ok=True)
        paths = [plot_latency_cdfs(results, os.path.join(args.plot_dir, "latency_cdf.png"), title)]
        if len(results) > 1:
            paths += plot_sweep(results, args.plot_dir, title)
        print("plots: " + ", ".join(paths))
    if args.json:
        write_json(args.json, args, backend, engine_args, results)
        print(f"json: {args.json}")
    return 0 if all(r.summary["completed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
