"""What tracing costs: full-stack throughput with tracing on (every request sampled) vs off.

Starts ``tandem serve`` once per configuration on free ports, runs the same workload
through it (client -> frontend -> engine over gRPC, concurrent streams), and prints output
tokens/s for each and their ratio. With tracing on, both services export every span over
OTLP/gRPC to a receiver inside this process (it counts what arrives); with tracing off no
OTEL_* variable is set at all. Configurations alternate (off, on, off, on, ...) over
``--repeats`` rounds so drift on a shared machine hits both alike; the best and the
median round of each are reported. (The receiver shares this machine's cores with the
services; a real collector would not.)

    python -m benchmarks.tracing_overhead                 # demo model, 64 requests x 64 tokens
    python -m benchmarks.tracing_overhead --smoke         # tiny model, a few requests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)

from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that only counts spans."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        n = sum(len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans)
        with self._lock:
            self.count += n
        return trace_service_pb2.ExportTraceServiceResponse()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(target: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"tandem serve at {target} not SERVING after {timeout:.0f}s")


async def _workload(target: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> int:
    """Send every prompt (at most ``concurrency`` at a time); return output tokens received."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: list[int]) -> int:
            request = frontend_pb2.GenerateRequest(
                prompt_token_ids=frontend_pb2.TokenIds(token_ids=prompt),
                sampling_params=common_pb2.SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                    output_kind=common_pb2.OUTPUT_KIND_DELTA,
                ),
            )
            async with gate:
                tokens = 0
                async for response in stub.Generate(request, timeout=600):
                    tokens += sum(len(o.token_ids) for o in response.outputs)
                return tokens

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def run_round(
    model: str,
    traced: bool,
    sink_port: int,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    engine_args: list[str],
) -> dict[str, float]:
    port, engine_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if traced:
        env.update(
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink_port}",
            OTEL_TRACES_SAMPLER="always_on",
        )
    cmd = [
        sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", "serve", "--model", model,
        "--port", str(port), "--engine-base-port", str(engine_port),
        "--metrics-port", "0", "--engine-metrics-base-port", "0", "--http-port", "0",
        "--", "--log-stats-interval", "0", *engine_args,
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, env=env, cwd=root)
    target = f"127.0.0.1:{port}"
    try:
        _wait_serving(target, proc, 300)
        asyncio.run(_workload(target, prompts[:2], 2, 2))  # warm-up
        start = time.perf_counter()
        tokens = asyncio.run(_workload(target, prompts, max_tokens, concurrency))
        seconds = time.perf_counter() - start
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "req_s": len(prompts) / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="checkpoint dir; default: the demo model")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="rounds of (off, on)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few requests, one round")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("engine_args", nargs="*", help="extra engine flags (after --)")
    args = ap.parse_args()

    model = args.model
    if args.smoke:
        from engine_service.make_model import make_model

        model = make_model(tempfile.mkdtemp(prefix="tandem-trace-bench-"), "llama", "tiny", seed=0)
        args.num_requests, args.prompt_len, args.max_tokens = 8, 16, 16
        args.concurrency, args.repeats = 4, 1
    elif not model:
        from engine_service.make_model import demo_model_dir

        model = demo_model_dir()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]

    sink = SpanSink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    sink_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    try:
        for round_index in range(args.repeats):
            for name in ("off", "on"):
                result = run_round(
                    model, name == "on", sink_port, prompts, args.max_tokens, args.concurrency,
                    args.engine_args,
                )
                results[name].append(result)
                print(f"round {round_index + 1} tracing {name:3}: {result['tokens']} tokens in "
                      f"{result['seconds']:.2f}s = {result['tok_s']:.1f} tok/s", flush=True)
    finally:
        server.stop(1)

    best = {name: max(rounds, key=lambda r: r["tok_s"]) for name, rounds in results.items()}
    median = {name: statistics.median(r["tok_s"] for r in rounds) for name, rounds in results.items()}
    ratio = best["on"]["tok_s"] / best["off"]["tok_s"]
    median_ratio = median["on"] / median["off"]
    print(f"\nworkload: {args.num_requests} requests x {args.prompt_len} prompt + {args.max_tokens} "
          f"output tokens, {args.concurrency} concurrent, model {os.path.basename(model.rstrip('/'))}")
    print(f"tracing off: best {best['off']['tok_s']:9.1f} tok/s  median {median['off']:9.1f} tok/s")
    print(f"tracing on:  best {best['on']['tok_s']:9.1f} tok/s  median {median['on']:9.1f} tok/s  "
          f"(every request sampled; {sink.count} spans received)")
    print(f"on / off:    best {ratio:.3f}  median {median_ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": results, "best": best, "ratio": ratio, "median_tok_s": median,
                       "median_ratio": median_ratio, "spans": sink.count,
                       "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                                    "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                                    "model": model}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
