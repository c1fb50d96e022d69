"""Prefix-cache hits under each placement policy: least-load vs prefix-aware.

Starts ``--engines`` engines once, then for each policy a fresh frontend (the engines'
prefix caches reset in between), and sends the same workload: ``--groups`` shared
prefixes of ``--prefix-len`` tokens, ``--per-group`` requests each with a distinct
``--suffix-len``-token tail, in a shuffled order with ``--concurrency`` calls in flight.
Reports the prompt tokens served from the engines' prefix caches (``usage.cached_tokens``)
and the wall time per policy. Example (tiny model, a few seconds per policy on CPU)::

    python -m benchmarks.prefix_placement --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import cached_model, format_table
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc

ENGINE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory-bytes", "20000000", "--num-threads", "1")


# Given to the services it starts, so it may reset the engines' prefix caches.
ADMIN_TOKEN = "prefix-placement-benchmark"

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_serving(address: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process for {address} exited with {proc.returncode}")
        # A fresh channel each time: a channel that failed to connect backs off for long.
        with grpc.insecure_channel(address) as channel, contextlib.suppress(grpc.RpcError):
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{address} not SERVING within {timeout:.0f}s")


@contextlib.contextmanager
def service(args: list[str], log: Path, timeout: float) -> Iterator[str]:
    """A ``tandem`` subprocess on a free port; yields its address once SERVING."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", *args, "--host", "127.0.0.1", "--port", str(port),
             "--metrics-port", "0"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "TANDEM_ADMIN_TOKEN": ADMIN_TOKEN},
        )
    try:
        wait_serving(address, proc, timeout)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.groups):
        prefix = [rng.randrange(10, vocab) for _ in range(args.prefix_len)]
        for _ in range(args.per_group):
            prompts.append(prefix + [rng.randrange(10, vocab) for _ in range(args.suffix_len)])
    rng.shuffle(prompts)
    return prompts


async def run_workload(address: str, prompts: list[list[int]], concurrency: int) -> tuple[int, int, float]:
    """(cached prompt tokens, prompt tokens, wall seconds)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    cached = total = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)

        async def worker() -> None:
            nonlocal cached, total
            while not queue.empty():
                prompt = queue.get_nowait()
                request = frontend_pb2.GenerateRequest(
                    prompt_token_ids=frontend_pb2.TokenIds(token_ids=prompt),
                    sampling_params=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                )
                last = None
                async for response in stub.Generate(request, timeout=300):
                    last = response
                if last is None:
                    raise RuntimeError("empty stream")
                cached += last.usage.cached_tokens
                total += last.usage.prompt_tokens

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return cached, total, time.perf_counter() - start


def reset_caches(engines: list[str]) -> None:
    for address in engines:
        with grpc.insecure_channel(address) as channel:
            engine_pb2_grpc.EngineCoreStub(channel).ResetPrefixCache(
                engine_pb2.ResetPrefixCacheRequest(), timeout=60,
                metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),),
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Checkpoint dir (default: the cached tiny Llama).")
    p.add_argument("--engines", type=int, default=2, help="Engines (default 2).")
    p.add_argument("--groups", type=int, default=4, help="Distinct shared prefixes (default 4).")
    p.add_argument("--per-group", type=int, default=8, help="Requests per prefix (default 8).")
    p.add_argument("--prefix-len", type=int, default=256, help="Shared prefix tokens (default 256).")
    p.add_argument("--suffix-len", type=int, default=16, help="Distinct tail tokens (default 16).")
    p.add_argument("--concurrency", type=int, default=4, help="Calls in flight (default 4).")
    p.add_argument("--seed", type=int, default=0, help="Workload seed (default 0).")
    p.add_argument("--timeout", type=float, default=300.0, help="Seconds to wait for SERVING (default 300).")
    args = p.parse_args()
    model = args.model or cached_model("tiny")
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="prefix-placement-")))
        engines = [
            stack.enter_context(service(
                ["engine", "--model", model, "--engine-index", str(i), *ENGINE_ARGS], logs / f"engine{i}.log",
                args.timeout,
            ))
            for i in range(args.engines)
        ]
        with grpc.insecure_channel(engines[0]) as channel:
            info = engine_pb2_grpc.EngineCoreStub(channel).GetEngineInfo(engine_pb2.GetEngineInfoRequest())
        prompts = make_prompts(args, info.vocab_size)
        rows = []
        for policy in ("least-load", "prefix-aware"):
            reset_caches(engines)
            targets = [a for e in engines for a in ("--engine", e)]
            with service(["frontend", "--model", model, "--placement", policy, "--http-port", "0", *targets],
                         logs / f"frontend-{policy}.log", args.timeout) as frontend:
                cached, total, wall = asyncio.run(run_workload(frontend, prompts, args.concurrency))
            rows.append([policy, len(prompts), total, cached, f"{100 * cached / max(total, 1):.1f}%", f"{wall:.2f}"])
        blocks = args.prefix_len // info.block_size * info.block_size
        best = args.groups * (args.per_group - 1) * blocks
        print(f"{args.engines} engines, {args.groups} prefixes x {args.per_group} requests, "
              f"prefix {args.prefix_len} + tail {args.suffix_len} tokens, concurrency {args.concurrency}; "
              f"at most ~{best} cached tokens (one miss per prefix, block size {info.block_size})")
        print(format_table(["placement", "requests", "prompt tokens", "cached tokens", "hit", "wall s"], rows))


if __name__ == "__main__":
    main()
