"""What the gRPC split costs.

1. Serialization: encode + decode of one engine step's EngineCoreOutputs for N requests
   (one new token each), the engine's domain outputs -> bytes -> the frontend's, as
   Protobuf (our tandem.v1 messages, via tandem.protocol.convert) and as msgspec
   array-like Structs shaped like vLLM's (see bench_serialization for what each times).
2. Frontend step: received bytes -> one RequestOutput per request for a plain decode
   step, reading the step as columns vs as one object per request.
3. Full stack vs in-process: the same workload through ``tandem serve`` (client ->
   frontend -> engine over gRPC) and through the in-process ``LLM``; output tokens/s
   and their ratio.

    python benchmarks/grpc_hop.py                 # demo model, 64 requests
    python benchmarks/grpc_hop.py --smoke         # tiny model, a few requests
    python benchmarks/grpc_hop.py --hop-only      # parts 1 and 2 only

Part 3 alternates the two sides (``--stack-repeats``, ABBA order): this VM's memory
bandwidth drifts 20-30% within minutes, so one stack run against one in-process run
measures the drift as much as the hop.
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
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
    TokenColumns,
)
from tandem.protocol.sampling_params import RequestOutputKind, SamplingParams


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


def _decode_step(num_requests: int) -> tuple[list[str], list[int]]:
    ids = [f"req-{i:06d}-{random.getrandbits(32):08x}" for i in range(num_requests)]
    return ids, [random.randrange(50_000) for _ in range(num_requests)]


def bench_serialization(num_requests: int, repeats: int) -> dict[str, float]:
    """The per-step cost of the hop for a decode step of ``num_requests`` requests (one
    new token each), from what the engine has after the step to what the frontend reads.

    - protobuf (columns), the stack's path: the engine's ``EngineCoreOutputs`` holds the
      step as ``TokenColumns`` (three lists, built by ``StepOutputs.make``);
      encode = convert + serialize; decode = parse + convert back to the
      ``EngineCoreOutputs`` with ``TokenColumns`` that ``AsyncLLM`` consumes.
    - protobuf (objects), for reference: one ``EngineCoreOutput`` per request on both
      ends (the path before issue 15: encode splits them into columns, decode makes the
      objects again via ``all_outputs()``).
    - msgspec: encode prebuilt vLLM-shaped array-like Structs, decode into those Structs
      (one Struct per request on both ends, as vLLM's engine and frontend have).

    Building the inputs (the engine's outputs; the received bytes) is not timed on any
    side. All six functions are interleaved, so load changes hit them alike."""
    ids, tokens = _decode_step(num_requests)
    stats = SchedulerStats(num_running_reqs=num_requests, kv_cache_usage=0.42)
    outs = EngineCoreOutputs(token_columns=TokenColumns(ids, tokens), scheduler_stats=stats)
    object_outs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(rid, [t]) for rid, t in zip(ids, tokens)],
        scheduler_stats=stats,
        timestamp=outs.timestamp,
    )
    parse = convert.engine_pb2.EngineCoreOutputs.FromString

    def proto_encode() -> bytes:
        return convert.engine_core_outputs_to_proto(outs).SerializeToString()

    def proto_objects_encode() -> bytes:
        return convert.engine_core_outputs_to_proto(object_outs).SerializeToString()

    proto_data = proto_encode()
    assert proto_objects_encode() == proto_data  # the same message either way

    def proto_decode() -> EngineCoreOutputs:
        return convert.engine_core_outputs_from_proto(parse(proto_data))

    def proto_objects_decode() -> list[EngineCoreOutput]:
        return convert.engine_core_outputs_from_proto(parse(proto_data)).all_outputs()

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

    assert proto_decode() == outs
    assert proto_objects_decode() == object_outs.outputs
    assert decoder.decode(msg_data) == msg_outs
    t = _interleaved_medians_us(
        {
            "protobuf_encode_us": proto_encode,
            "protobuf_decode_us": proto_decode,
            "protobuf_objects_encode_us": proto_objects_encode,
            "protobuf_objects_decode_us": proto_objects_decode,
            "msgspec_encode_us": msgspec_encode,
            "msgspec_decode_us": msgspec_decode,
        },
        repeats,
    )
    proto_us = t["protobuf_encode_us"] + t["protobuf_decode_us"]
    objects_us = t["protobuf_objects_encode_us"] + t["protobuf_objects_decode_us"]
    msgspec_us = t["msgspec_encode_us"] + t["msgspec_decode_us"]
    return {
        **t,
        "protobuf_us": proto_us,
        "protobuf_objects_us": objects_us,
        "msgspec_us": msgspec_us,
        "ratio": proto_us / msgspec_us,
        "objects_ratio": objects_us / msgspec_us,
        "protobuf_bytes": len(proto_data),
        "msgspec_bytes": len(msg_data),
    }


def bench_frontend_step(tokenizer: Any, num_requests: int, repeats: int) -> dict[str, float]:
    """The frontend's work for one plain decode step of ``num_requests`` DELTA requests:
    received bytes -> ``RequestOutput`` per request (decode, detokenize, build outputs),
    with the step read as columns (today) and as one EngineCoreOutput per request (the
    path before issue 15). Two processors hold the same requests; interleaved medians."""
    from frontend_service.input_processor import InputProcessor
    from frontend_service.output_processor import OutputProcessor

    ids, _ = _decode_step(num_requests)
    vocab = len(tokenizer)
    inputs = InputProcessor(tokenizer, 1 << 20, vocab, 0, None)
    params = SamplingParams(max_tokens=None, output_kind=RequestOutputKind.DELTA)
    processors = {"columns": OutputProcessor(tokenizer), "objects": OutputProcessor(tokenizer)}
    for rid in ids:
        for processor in processors.values():
            processor.add_processed(inputs.process(rid, params, prompt_token_ids=[5, 6, 7]))
    steps = [
        convert.engine_core_outputs_to_proto(
            EngineCoreOutputs(token_columns=TokenColumns(ids, [random.randrange(5, vocab) for _ in ids]))
        ).SerializeToString()
        for _ in range(16)
    ]
    parse = convert.engine_pb2.EngineCoreOutputs.FromString
    turn = {"columns": 0, "objects": 0}

    def columns() -> None:
        outs = convert.engine_core_outputs_from_proto(parse(steps[turn["columns"] % len(steps)]))
        turn["columns"] += 1
        done = processors["columns"].process_outputs(outs.outputs, outs.token_columns)
        assert len(done.request_outputs) == num_requests

    def objects() -> None:
        outs = convert.engine_core_outputs_from_proto(parse(steps[turn["objects"] % len(steps)]))
        turn["objects"] += 1
        done = processors["objects"].process_outputs(outs.all_outputs())
        assert len(done.request_outputs) == num_requests

    t = _interleaved_medians_us({"columns_us": columns, "objects_us": objects}, repeats)
    return {**t, "saved_us": t["objects_us"] - t["columns_us"]}


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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def bench_stack(
    model: str, prompts: list[list[int]], max_tokens: int, engine_args: list[str], repeats: int = 3
) -> dict[str, Any]:
    """The workload through the full stack (this process is the gRPC client; ``tandem
    serve`` runs the frontend and one engine process) and through an in-process ``LLM``
    with the same engine settings, ``repeats`` times each, in ABBA order (stack, local,
    local, stack, ...) so that drift of the machine's speed hits both sides alike. Both
    stay loaded throughout; the idle one blocks on its input queue. Each side first runs
    the workload once untimed.

    Also the CPU seconds each stack process used during the stack runs: on a machine
    where the engine's compute threads fill every core, the frontend's and the client's
    work is what the stack takes from the engine."""
    from frontend_service import LLM, SamplingParams

    port, engine_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", "serve", "--model", model,
           "--port", str(port), "--engine-base-port", str(engine_port), "--http-port", "0",
           "--", *engine_args]
    proc = subprocess.Popen(cmd)
    target = f"127.0.0.1:{port}"
    kwargs = {}
    for flag, value in zip(engine_args[::2], engine_args[1::2]):
        kwargs[flag.lstrip("-").replace("-", "_")] = int(value)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runs: dict[str, list[float]] = {"grpc": [], "local": []}
    cpu = {"client": 0.0, "frontend": 0.0, "engine": 0.0}
    tokens = {"grpc": 0, "local": 0}
    try:
        _wait_ready(target, 300)
        engine_pids = _children(proc.pid)
        llm = LLM(model=model, **kwargs)
        # Warm-up, untimed: the whole workload once on each side (first touch of the KV
        # cache and the step buffers, first use of every batch shape).
        asyncio.run(_grpc_workload(target, prompts, max_tokens))
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)

        def run_grpc() -> None:
            before = (time.process_time(), _cpu_seconds(proc.pid), sum(map(_cpu_seconds, engine_pids)))
            start = time.perf_counter()
            tokens["grpc"] = asyncio.run(_grpc_workload(target, prompts, max_tokens))
            runs["grpc"].append(time.perf_counter() - start)
            cpu["client"] += time.process_time() - before[0]
            cpu["frontend"] += _cpu_seconds(proc.pid) - before[1]
            cpu["engine"] += sum(map(_cpu_seconds, engine_pids)) - before[2]

        def run_local() -> None:
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            runs["local"].append(time.perf_counter() - start)
            tokens["local"] = sum(len(c.token_ids) for o in outs for c in o.outputs)

        for i in range(repeats):
            for run in (run_grpc, run_local) if i % 2 == 0 else (run_local, run_grpc):
                run()
    finally:
        proc.terminate()
        proc.wait(30)
    grpc_tps = [tokens["grpc"] / s for s in runs["grpc"]]
    local_tps = [tokens["local"] / s for s in runs["local"]]
    ratios = sorted(g / c for g, c in zip(grpc_tps, local_tps))
    grpc_s = sum(runs["grpc"])
    return {
        "grpc_tokens": tokens["grpc"], "local_tokens": tokens["local"],
        "grpc_tok_s": grpc_tps, "local_tok_s": local_tps, "ratios": ratios,
        "ratio": ratios[len(ratios) // 2],
        "ratio_total": (tokens["grpc"] * repeats / grpc_s) / (tokens["local"] * repeats / sum(runs["local"])),
        # Share of one core each process used while the stack ran.
        "cpu_share": {name: seconds / grpc_s for name, seconds in cpu.items()},
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
    ap.add_argument("--repeats", type=int, default=0,
                    help="timed repeats of the serialization part (default 0: 1000, 200 with --smoke; "
                         "the frontend-step part runs a tenth as many)")
    ap.add_argument("--stack-repeats", type=int, default=3,
                    help="runs of the stack and of the in-process LLM each, interleaved (default 3)")
    ap.add_argument("--hop-only", action="store_true",
                    help="only parts 1 and 2 (serialization, frontend step), not the full stack (default off)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    random.seed(0)

    repeats = args.repeats or (200 if args.smoke else 1000)
    ser = bench_serialization(args.serialize_requests, repeats)
    n = args.serialize_requests
    print(f"EngineCoreOutputs, {n} requests x 1 token, engine's outputs -> bytes -> frontend's (median):")
    print(f"  protobuf, columns (the stack)  {ser['protobuf_us']:7.1f} us"
          f" (encode {ser['protobuf_encode_us']:.1f} + decode {ser['protobuf_decode_us']:.1f},"
          f" {ser['protobuf_bytes']} B)   ratio {ser['ratio']:.2f}x")
    print(f"  protobuf, objects on both ends {ser['protobuf_objects_us']:7.1f} us"
          f" (encode {ser['protobuf_objects_encode_us']:.1f} + decode {ser['protobuf_objects_decode_us']:.1f})"
          f"   ratio {ser['objects_ratio']:.2f}x")
    print(f"  msgspec (vLLM-shaped structs)  {ser['msgspec_us']:7.1f} us"
          f" (encode {ser['msgspec_encode_us']:.1f} + decode {ser['msgspec_decode_us']:.1f},"
          f" {ser['msgspec_bytes']} B)")

    model = args.model
    if args.smoke:
        from engine_service.make_model import make_model

        model = make_model(tempfile.mkdtemp(prefix="tandem-hop-"), "llama", "tiny", seed=0)
        args.num_requests, args.prompt_len, args.max_tokens = 4, 16, 8
    elif not model:
        from engine_service.make_model import demo_model_dir

        model = demo_model_dir()
    from transformers import AutoTokenizer

    front = bench_frontend_step(AutoTokenizer.from_pretrained(model), n, max(repeats // 10, 5))
    print(f"\nFrontend, one plain decode step of {n} DELTA requests, bytes -> RequestOutputs (median):")
    print(f"  read as columns   {front['columns_us']:8.1f} us")
    print(f"  read as objects   {front['objects_us']:8.1f} us   (saved {front['saved_us']:.1f} us)")
    result: dict[str, Any] = {"serialization": ser, "frontend_step": front, "model": model}
    if args.hop_only:
        _write_json(args.json, result)
        return 0

    from tandem.protocol.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(model).vocab_size
    prompts = [[random.randrange(5, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    engine_args = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(args.kv_cache_mib * 2**20),
                   "--num-threads", str(os.cpu_count() or 1)]
    stack = bench_stack(model, prompts, args.max_tokens, engine_args, args.stack_repeats)
    print(f"\n{args.num_requests} requests x {args.prompt_len} prompt / {args.max_tokens} output tokens,"
          f" {args.stack_repeats} runs each, interleaved:")
    print("  full gRPC stack   " + " ".join(f"{t:7.1f}" for t in stack["grpc_tok_s"]) + " output tok/s")
    print("  in-process LLM    " + " ".join(f"{t:7.1f}" for t in stack["local_tok_s"]) + " output tok/s")
    print("  ratio gRPC / in-process, pair by pair: " + " ".join(f"{r:.3f}" for r in stack["ratios"])
          + f"; median {stack['ratio']:.3f}; all runs {stack['ratio_total']:.3f}")
    share = stack["cpu_share"]
    print(f"  CPU during the stack runs (cores): engine {share['engine']:.2f},"
          f" frontend {share['frontend']:.2f}, client {share['client']:.2f}")
    _write_json(args.json, {**result, "stack": stack})
    return 0


def _write_json(path: str, doc: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
