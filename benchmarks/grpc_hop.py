"""What the gRPC split costs.

1. Serialization: encode + decode of one engine step's EngineCoreOutputs for N requests
   (one new token each), domain objects -> bytes -> domain objects, as Protobuf (our
   tandem.v1 messages, via tandem.protocol.convert) and as msgspec array-like Structs
   shaped like vLLM's.
2. Full stack vs in-process: the same workload through ``tandem serve`` (client ->
   frontend -> engine over gRPC) and through the in-process ``LLM``; output tokens/s
   and their ratio.

    python benchmarks/grpc_hop.py                 # demo model, 64 requests
    python benchmarks/grpc_hop.py --smoke         # tiny model, a few requests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec

from tandem.protocol import convert
from tandem.protocol.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats


class MsgOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class MsgStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


class MsgOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[MsgOutput] = []
    scheduler_stats: MsgStats | None = None
    timestamp: float = 0.0


def _median_us(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e6


def _interleaved_medians_us(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median time of each function, run in turn so that load changes hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] * 1e6 for name, t in times.items()}


def bench_serialization(num_requests: int, repeats: int) -> dict[str, float]:
    """The per-step cost of the hop for a decode step of ``num_requests`` requests
    (one new token each): the engine turns its domain outputs into bytes, the frontend
    turns the bytes back into domain outputs. Both sides start from objects that exist
    anyway (the scheduler's outputs; the received bytes), so building those is not
    timed; msgspec gets the same: encode Structs, decode into Structs."""
    ids = [f"req-{i:06d}-{random.getrandbits(32):08x}" for i in range(num_requests)]
    tokens = [random.randrange(50_000) for _ in range(num_requests)]
    outs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(rid, [t]) for rid, t in zip(ids, tokens)],
        scheduler_stats=SchedulerStats(num_running_reqs=num_requests, kv_cache_usage=0.42),
    )
    parse = convert.engine_pb2.EngineCoreOutputs.FromString

    def proto_encode() -> bytes:
        return convert.engine_core_outputs_to_proto(outs).SerializeToString()

    proto_data = proto_encode()

    def proto_decode() -> EngineCoreOutputs:
        return convert.engine_core_outputs_from_proto(parse(proto_data))

    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(MsgOutputs)
    msg_outs = MsgOutputs(
        outputs=[MsgOutput(rid, [t]) for rid, t in zip(ids, tokens)],
        scheduler_stats=MsgStats(num_requests, 0, 0.42),
    )
    msg_data = encoder.encode(msg_outs)

    def msgspec_encode() -> bytes:
        return encoder.encode(msg_outs)

    def msgspec_decode() -> MsgOutputs:
        return decoder.decode(msg_data)

    assert convert.engine_core_outputs_from_proto(parse(proto_data)) == outs
    assert decoder.decode(msg_data) == msg_outs
    t = _interleaved_medians_us(
        {
            "protobuf_encode_us": proto_encode,
            "protobuf_decode_us": proto_decode,
            "msgspec_encode_us": msgspec_encode,
            "msgspec_decode_us": msgspec_decode,
        },
        repeats,
    )
    proto_us = t["protobuf_encode_us"] + t["protobuf_decode_us"]
    msgspec_us = t["msgspec_encode_us"] + t["msgspec_decode_us"]
    return {
        **t,
        "protobuf_us": proto_us,
        "msgspec_us": msgspec_us,
        "ratio": proto_us / msgspec_us,
        "protobuf_bytes": len(proto_data),
        "msgspec_bytes": len(msg_data),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _grpc_workload(target: str, prompts: list[list[int]], max_tokens: int) -> int:
    import grpc

    from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)

        async def one(prompt: list[int]) -> int:
            params = common_pb2.SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                output_kind=common_pb2.OUTPUT_KIND_DELTA,
            )
            req = frontend_pb2.GenerateRequest(
                prompt_token_ids=frontend_pb2.TokenIds(token_ids=prompt), sampling_params=params
            )
            n = 0
            async for resp in stub.Generate(req, timeout=3600):
                n += sum(len(o.token_ids) for o in resp.outputs)
            return n

        counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts)


def _wait_ready(target: str, timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.time() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.time() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"frontend at {target} not SERVING after {timeout}s")


def bench_stack(model: str, prompts: list[list[int]], max_tokens: int, engine_args: list[str]) -> dict[str, float]:
    from frontend_service import LLM, SamplingParams

    port, engine_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", "serve", "--model", model,
           "--port", str(port), "--engine-base-port", str(engine_port), "--http-port", "0",
           "--", *engine_args]
    proc = subprocess.Popen(cmd)
    try:
        _wait_ready(f"127.0.0.1:{port}", 300)
        asyncio.run(_grpc_workload(f"127.0.0.1:{port}", prompts[:2], 2))  # warm-up
        start = time.perf_counter()
        grpc_tokens = asyncio.run(_grpc_workload(f"127.0.0.1:{port}", prompts, max_tokens))
        grpc_s = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(30)

    kwargs = {}
    for flag, value in zip(engine_args[::2], engine_args[1::2]):
        kwargs[flag.lstrip("-").replace("-", "_")] = int(value)
    llm = LLM(model=model, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    local_s = time.perf_counter() - start
    local_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    grpc_tps, local_tps = grpc_tokens / grpc_s, local_tokens / local_s
    return {
        "grpc_tokens": grpc_tokens, "grpc_s": grpc_s, "grpc_tok_s": grpc_tps,
        "local_tokens": local_tokens, "local_s": local_s, "local_tok_s": local_tps,
        "ratio": grpc_tps / local_tps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--serialize-requests", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="tiny model, few requests")
    ap.add_argument("--kv-cache-mib", type=int, default=256,
                    help="KV-cache budget of both engines; the default 256 MiB holds about half of "
                         "the 64 requests at once, so the run includes preemptions")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    random.seed(0)

    ser = bench_serialization(args.serialize_requests, repeats=200 if args.smoke else 1000)
    print(f"EngineCoreOutputs, {args.serialize_requests} requests x 1 token, domain -> bytes -> domain"
          " (median):")
    print(f"  protobuf (tandem.v1 + convert) {ser['protobuf_us']:7.1f} us"
          f" (encode {ser['protobuf_encode_us']:.1f} + decode {ser['protobuf_decode_us']:.1f},"
          f" {ser['protobuf_bytes']} B)")
    print(f"  msgspec (vLLM-shaped structs)  {ser['msgspec_us']:7.1f} us"
          f" (encode {ser['msgspec_encode_us']:.1f} + decode {ser['msgspec_decode_us']:.1f},"
          f" {ser['msgspec_bytes']} B)   ratio {ser['ratio']:.2f}x")

    model = args.model
    if args.smoke:
        from engine_service.make_model import make_model

        model = make_model(tempfile.mkdtemp(prefix="tandem-hop-"), "llama", "tiny", seed=0)
        args.num_requests, args.prompt_len, args.max_tokens = 4, 16, 8
    elif not model:
        from engine_service.make_model import demo_model_dir

        model = demo_model_dir()
    from tandem.protocol.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(model).vocab_size
    prompts = [[random.randrange(5, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    engine_args = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(args.kv_cache_mib * 2**20),
                   "--num-threads", str(os.cpu_count() or 1)]
    stack = bench_stack(model, prompts, args.max_tokens, engine_args)
    print(f"\n{args.num_requests} requests x {args.prompt_len} prompt / {args.max_tokens} output tokens:")
    print(f"  full gRPC stack   {stack['grpc_tok_s']:8.1f} output tok/s ({stack['grpc_s']:.2f}s)")
    print(f"  in-process LLM    {stack['local_tok_s']:8.1f} output tok/s ({stack['local_s']:.2f}s)")
    print(f"  ratio gRPC / in-process: {stack['ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"serialization": ser, "stack": stack, "model": model}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
