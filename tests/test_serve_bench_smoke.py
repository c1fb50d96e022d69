"""The online serving benchmark: metric math, workloads, the OpenAI stream client (canned
bytes and a fake in-process server), and one end-to-end smoke run against a launched
``tandem serve`` on the tiny Llama. No timing assertions."""

from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from benchmarks import serve_bench as sb
from benchmarks.common import FIRST_ORDINARY_TOKEN

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- metric math ---------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy(rng: random.Random) -> None:
    assert sb.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert sb.percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert sb.percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    assert sb.percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert sb.percentile([7.0], 99) == 7.0
    assert math.isnan(sb.percentile([], 50))
    values = [rng.expovariate(1.0) for _ in range(rng.randint(1, 200))]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert sb.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        sb.percentile(values, 101)


def test_distribution_summary() -> None:
    d = sb.distribution([0.001, 0.002, 0.003, 0.010], scale=1000.0)
    assert d["count"] == 4
    assert d["mean"] == pytest.approx(4.0)
    assert d["median"] == d["p50"] == pytest.approx(2.5)
    assert d["p50"] <= d["p90"] <= d["p99"] <= d["max"] == pytest.approx(10.0)
    assert d["min"] == pytest.approx(1.0)
    empty = sb.distribution([])
    assert empty["count"] == 0 and math.isnan(empty["mean"])


def test_tpot() -> None:
    assert sb.time_per_output_token(0.1, 1.1, 11) == pytest.approx(0.1)
    assert sb.time_per_output_token(0.1, 0.1, 1) is None
    assert sb.time_per_output_token(0.1, 0.5, 0) is None


def test_itl_splits_multi_token_chunks_evenly() -> None:
    # One token at 100 ms (the TTFT), one at 150 ms, then three in one chunk at 450 ms.
    itl = sb.inter_token_latencies([0.100, 0.150, 0.450], [1, 1, 3])
    assert itl == pytest.approx([0.05, 0.1, 0.1, 0.1])
    # Extra tokens in the first chunk arrived together with the first one.
    itl = sb.inter_token_latencies([0.2, 0.3], [3, 2])
    assert itl == pytest.approx([0.0, 0.0, 0.05, 0.05])
    assert sb.inter_token_latencies([], []) == []
    with pytest.raises(ValueError):
        sb.inter_token_latencies([0.1], [0])


def test_itl_count_and_sum_match_tpot(rng: random.Random) -> None:
    times, tokens, t = [], [], 0.0
    for _ in range(rng.randint(1, 30)):
        t += rng.uniform(0.001, 0.05)
        times.append(t)
        tokens.append(rng.randint(1, 4))
    itl = sb.inter_token_latencies(times, tokens)
    n = sum(tokens)
    assert len(itl) == n - 1
    assert sum(itl) == pytest.approx(times[-1] - times[0])
    if n > 1:  # with E2E at the last chunk, the request's mean ITL is its TPOT
        tpot = sb.time_per_output_token(times[0], times[-1], n)
        assert sum(itl) / len(itl) == pytest.approx(tpot)


def _record(chunks: list[tuple[float, int]], e2e: float, usage: int | None = None,
            index: int = 0) -> sb.RequestRecord:
    rec = sb.RequestRecord(index, "random", prompt_tokens=10, max_tokens=8)
    for at, n in chunks:
        rec.add_chunk(at, n)
    rec.finish(e2e, usage)
    return rec


def test_record_from_synthetic_stream() -> None:
    rec = _record([(0.05, 0), (0.2, 1), (0.3, 1), (0.6, 2)], e2e=0.62)
    assert rec.success and rec.status == "OK"
    assert rec.ttft == pytest.approx(0.2)  # the empty first chunk is no token
    assert rec.output_tokens == 4
    assert rec.tpot == pytest.approx((0.62 - 0.2) / 3)
    assert rec.itl == pytest.approx([0.1, 0.15, 0.15])
    assert _record([(0.1, 1)], e2e=0.1, usage=1).tpot is None
    empty = _record([(0.1, 0)], e2e=0.2)
    assert not empty.success and empty.status == "NO_OUTPUT"


def test_summarize_counts_and_throughput() -> None:
    ok1 = _record([(0.1, 1), (0.2, 1), (0.3, 1)], e2e=0.3, index=0)
    ok2 = _record([(0.3, 2), (0.5, 1)], e2e=0.5, index=1)
    bad = sb.RequestRecord(2, "random", 10, 8)
    bad.fail("UNAVAILABLE", "no engine")
    ok1.cached_tokens, ok2.cached_tokens = 0, 5
    s = sb.summarize([ok1, ok2, bad], duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["failed_by_status"] == {"UNAVAILABLE": 1}
    assert s["total_input_tokens"] == 20 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(13.0)
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(400.0)
    assert s["itl_ms"]["count"] == 4  # (3 - 1) + (3 - 1)
    assert s["itl_ms"]["mean"] == pytest.approx((100 + 100 + 0 + 200) / 4)
    assert s["tpot_ms"]["count"] == 2


# ---- workloads -------------------------------------------------------------------------------


def test_workloads_are_deterministic_and_in_range() -> None:
    kwargs = dict(input_len=40, output_len=10, range_ratio=0.5, num_prefixes=3,
                  prefix_len=(50, 80), suffix_len=8)
    a = sb.make_requests("mixed", 40, 300, seed=7, **kwargs)
    assert a == sb.make_requests("mixed", 40, 300, seed=7, **kwargs)
    assert a != sb.make_requests("mixed", 40, 300, seed=8, **kwargs)
    assert sum(s.kind == "shared-prefix" for s in a) == 20
    prefixes: dict[int, list[int]] = {}
    for s in a:
        assert all(FIRST_ORDINARY_TOKEN <= t < 300 for t in s.prompt)
        assert 5 <= s.max_tokens <= 15
        if s.kind == "random":
            assert 20 <= len(s.prompt) <= 60 and s.prefix_index is None
        else:
            assert 50 <= s.prefix_len <= 80
            assert 4 <= len(s.prompt) - s.prefix_len <= 12
            prefix = s.prompt[: s.prefix_len]
            assert prefixes.setdefault(s.prefix_index, prefix) == prefix
    assert sorted(prefixes) == [0, 1, 2]
    only = sb.make_requests("shared-prefix", 6, 300, seed=1, num_prefixes=2, prefix_len=(500, 1000))
    assert all(s.kind == "shared-prefix" and 500 <= s.prefix_len <= 1000 for s in only)
    assert {s.prefix_index for s in only} == {0, 1}
    with pytest.raises(ValueError):
        sb.make_requests("zipf", 4, 300, seed=0)


def test_length_range() -> None:
    assert sb.length_range(100, 0.0) == (100, 100)
    assert sb.length_range(100, 0.5) == (50, 150)
    assert sb.length_range(1, 0.9) == (1, 2)
    with pytest.raises(ValueError):
        sb.length_range(10, 1.0)


def test_arrival_times() -> None:
    assert sb.arrival_times(4, math.inf, seed=0) == [0.0] * 4
    times = sb.arrival_times(2000, 50.0, seed=3)
    assert times == sb.arrival_times(2000, 50.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / (len(times) - 1) == pytest.approx(1 / 50.0, rel=0.15)  # mean gap


# ---- OpenAI stream client ------------------------------------------------------------------------


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"


def _text_chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


CANNED_STREAM = (
    b": keep-alive comment\r\n\r\n"
    + _event(_text_chunk("Hel"))
    + _event(_text_chunk(""))  # an empty delta: no token
    + _event(_text_chunk("lo \u00e9"))
    + _event(_text_chunk("!", finish="length"))
    + _event({"id": "cmpl-1", "choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2}}})
    + b"data: [DONE]\r\n\r\n"
)


def _feed_in_pieces(data: bytes, cuts: list[int]) -> list[str]:
    parser = sb.SSEParser()
    events, last = [], 0
    for cut in [*cuts, len(data)]:
        events += parser.feed(data[last:cut])
        last = cut
    return events + parser.close()


def test_sse_parser_any_split(rng: random.Random) -> None:
    whole = _feed_in_pieces(CANNED_STREAM, [])
    assert len(whole) == 6 and whole[-1] == "[DONE]"
    assert json.loads(whole[2])["choices"][0]["text"] == "lo \u00e9"
    assert _feed_in_pieces(CANNED_STREAM, list(range(1, len(CANNED_STREAM)))) == whole  # byte by byte
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(CANNED_STREAM)), rng.randint(1, 30)))
        assert _feed_in_pieces(CANNED_STREAM, cuts) == whole


def test_sse_parser_line_endings_and_multiline_data() -> None:
    stream = b"event: x\ndata: a\ndata:b\n\ndata: c\r\rdata: d\r\n\r\nid: 3\n\ndata: tail"
    assert _feed_in_pieces(stream, []) == ["a\nb", "c", "d", "tail"]
    assert _feed_in_pieces(stream, [stream.index(b"\r") + 1]) == ["a\nb", "c", "d", "tail"]


def test_parse_completion_events() -> None:
    assert sb.parse_completion_event("[DONE]").done
    chunk = sb.parse_completion_event(json.dumps(_text_chunk("hi", finish="stop")))
    assert (chunk.text, chunk.tokens, chunk.finish_reason) == ("hi", 1, "stop")
    with_ids = _text_chunk("")
    with_ids["choices"][0]["token_ids"] = [4, 5]
    assert sb.parse_completion_event(json.dumps(with_ids)).tokens == 2
    usage = sb.parse_completion_event(json.dumps({"choices": [], "usage": {"completion_tokens": 9}}))
    assert (usage.tokens, usage.completion_tokens) == (0, 9)
    err = sb.parse_completion_event(json.dumps({"error": {"message": "boom", "code": 400}}))
    assert err.error == "boom"
    assert sb.parse_completion_event("{not json").error


def _chunked(body: bytes, size: int) -> bytes:
    out = b""
    for i in range(0, len(body), size):
        part = body[i:i + size]
        out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    return out + b"0\r\n\r\n"


def test_http_response_and_stream_from_canned_bytes() -> None:
    raw = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(CANNED_STREAM, 37))

    async def go() -> sb.RequestRecord:
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        response = await sb.read_response_head(reader)
        assert response.status == 200
        assert response.headers["content-type"] == "text/event-stream"
        rec = sb.RequestRecord(0, "random", 5, 3)
        start = time.perf_counter()
        usage = await sb.consume_completion_stream(response.iter_body(), rec, start)
        rec.finish(time.perf_counter() - start, usage)
        return rec

    rec = asyncio.run(go())
    assert rec.success and rec.finish_reason == "length"
    assert rec.output_tokens == 3 and rec.chunk_tokens == [1, 1, 1]
    assert rec.cached_tokens == 2
    assert rec.ttft is not None and rec.ttft <= rec.e2e
    assert len(rec.itl) == 2


# A fake OpenAI-compatible server in-process: streams CANNED_STREAM, rejects, or hangs.
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> dict:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return json.loads(await reader.readexactly(length))


async def _serve_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    body = await _read_request(reader)
    assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert all(isinstance(t, int) for t in body["prompt"])
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    for i in range(0, len(CANNED_STREAM), 50):
        part = CANNED_STREAM[i:i + 50]
        writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.001)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


async def _serve_400(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    body = b'{"error": {"message": "max_tokens too large"}}'
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    writer.close()


async def _serve_hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(3600)


def _run_against(handler: Handler, n: int, timeout: float = 30.0) -> sb.RunResult:
    async def go() -> sb.RunResult:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        backend = sb.OpenAIBackend(f"http://127.0.0.1:{port}", "m")
        specs = sb.make_requests("random", n, 100, seed=0, input_len=8, output_len=3)
        try:
            return await sb.run_load(backend, specs, math.inf, 2, timeout, seed=0, progress=False)
        finally:
            server.close()

    return asyncio.run(go())


def test_openai_backend_against_fake_server() -> None:
    result = _run_against(_serve_stream, 3)
    assert result.summary["completed"] == 3, [r.error for r in result.records]
    for rec in result.records:
        assert rec.output_tokens == 3 and rec.ttft <= rec.e2e and len(rec.itl) == 2
    assert result.summary["total_output_tokens"] == 9


def test_openai_backend_errors_are_failed_requests() -> None:
    result = _run_against(_serve_400, 2)
    assert result.summary["failed_by_status"] == {"HTTP 400": 2}
    assert "max_tokens too large" in result.records[0].error
    hung = _run_against(_serve_hang, 2, timeout=0.5)  # must end, not hang
    assert hung.summary["failed_by_status"] == {"TIMEOUT": 2}


# ---- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_run(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, Path]:
    tmp = tmp_path_factory.mktemp("serve_bench")
    out, plots = tmp / "result.json", tmp / "plots"
    cmd = [
        sys.executable, "-m", "benchmarks.serve_bench", "--launch", "--model", tiny_llama_dir,
        "--num-requests", "6", "--workload", "mixed", "--input-len", "48", "--output-len", "12",
        "--range-ratio", "0.5", "--num-prefixes", "2", "--request-rates", "20,inf",
        "--max-concurrency", "4", "--timeout", "120", "--no-progress",
        "--json", str(out), "--plot-dir", str(plots), "--launch-log", str(tmp / "serve.log"),
        "--", "--max-model-len", "2048", "--kv-cache-memory-bytes", "20000000", "--num-threads", "1",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    log = (tmp / "serve.log").read_text(errors="replace")[-3000:] if (tmp / "serve.log").exists() else ""
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}\nlog:\n{log}"
    return proc.stdout, json.loads(out.read_text()), plots


def test_smoke_all_requests_complete(smoke_run: tuple[str, dict, Path]) -> None:
    _, doc, _ = smoke_run
    assert doc["backend"] == "tandem"
    assert [run["request_rate"] for run in doc["runs"]] == [20.0, "inf"]
    for run in doc["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (6, 0), s["failed_by_status"]
        assert len(run["requests"]) == 6
        assert {r["kind"] for r in run["requests"]} == {"random", "shared-prefix"}
        for r in run["requests"]:
            assert r["success"] and r["status"] == "OK"
            assert r["output_tokens"] > 0
            assert r["output_tokens"] == r["max_tokens"] == sum(r["chunk_tokens"])  # ignore_eos
            assert 0 < r["ttft"] <= r["e2e"]
            assert len(r["itl"]) == r["output_tokens"] - 1
            assert r["cached_tokens"] is not None
        assert s["total_output_tokens"] == sum(r["output_tokens"] for r in run["requests"])
        assert s["request_throughput"] > 0 and s["output_throughput"] > 0


def test_smoke_percentiles_ordered(smoke_run: tuple[str, dict, Path]) -> None:
    _, doc, _ = smoke_run
    for run in doc["runs"]:
        for name in ("ttft", "tpot", "itl", "e2e"):
            d = run["summary"][f"{name}_ms"]
            assert d["count"] > 0
            assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (name, d)
            assert d["min"] <= d["mean"] <= d["max"]


def test_smoke_table_and_plots(smoke_run: tuple[str, dict, Path]) -> None:
    stdout, _, plots = smoke_run
    for text in ("request throughput", "output throughput", "latency (ms)", "TTFT", "TPOT",
                 "ITL", "E2E", "== sweep"):
        assert text in stdout, stdout
    for name in ("latency_cdf.png", "sweep_throughput.png", "sweep_ttft.png"):
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
