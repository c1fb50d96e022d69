"""Tensor parallelism on this machine: TP=1 against TP=2 with the same total threads,
the measured all-reduce latency and bandwidth of the collectives backend, and from
those a projection of the per-step all-reduce cost of larger models.

    python -m benchmarks.tensor_parallel                 # bench-135m, gloo on CPU
    python -m benchmarks.tensor_parallel --smoke         # tiny model, a few sizes
    python -m benchmarks.tensor_parallel --device cuda   # NCCL (needs 2 GPUs)

The engine comparison runs the same greedy workload on both (and checks the tokens
agree): a prefill-heavy step and decode steps, timed per step. The projection: a
decoder step under TP makes 2 all-reduces per layer (o_proj, down_proj) plus one for
the embedding, each of ``num_tokens x hidden_size`` activations, so it costs about
``(2 L + 1) (alpha + tokens * hidden * bytes / beta)`` with alpha (latency) and beta
(bandwidth) fitted to the measured all-reduces.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from typing import Any

from benchmarks.common import cached_model, format_table, load_average

# (name, hidden_size, num_layers): the shapes the projection is made for.
PROJECTED_MODELS = [
    ("bench-135m", 576, 30),
    ("Llama-3.1-8B", 4096, 32),
    ("Qwen2.5-32B", 5120, 64),
    ("Llama-3.1-70B", 8192, 80),
]


# ---- collectives -----------------------------------------------------------------


def _time_all_reduce(comm: Any, sizes: list[int], iters: int, device: Any) -> list[float]:
    """Median seconds of one all-reduce of each byte size (float32 elements)."""
    import torch

    medians = []
    for size in sizes:
        x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        for _ in range(10):
            comm.all_reduce(x)
        samples = []
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            comm.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        medians.append(statistics.median(samples))
    return medians


def _peer(rank: int, spec: Any, sizes: list[int], iters: int, device_name: str) -> None:
    import torch

    from engine_service.distributed.parallel_state import Communicator, device_for_rank

    torch.set_num_threads(1)
    device = device_for_rank(torch.device(device_name), rank)
    comm = Communicator(rank, spec, device)
    _time_all_reduce(comm, sizes, iters, device)
    comm.close()


def measure_all_reduce(sizes: list[int], iters: int, device_name: str) -> tuple[str, list[float]]:
    """Two ranks (this process and one spawned); (backend, median seconds per size)."""
    import torch

    from engine_service.distributed.parallel_state import (
        Communicator,
        ParallelSpec,
        default_init_method,
        device_for_rank,
        resolve_backend,
    )

    device = torch.device(device_name)
    spec = ParallelSpec(2, default_init_method(), resolve_backend("auto", device))
    peer = multiprocessing.get_context("spawn").Process(
        target=_peer, args=(1, spec, sizes, iters, device_name), daemon=True
    )
    peer.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    comm = Communicator(0, spec, device_for_rank(device, 0))
    try:
        times = _time_all_reduce(comm, sizes, iters, comm.device)
    finally:
        comm.close()
        peer.join(30)
        torch.set_num_threads(threads)
    return spec.backend, times


def fit_latency_bandwidth(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """``t = alpha + size / beta`` through the smallest size (latency-bound) and the
    largest (bandwidth-bound); (alpha seconds, beta bytes/s). ``sizes`` ascending."""
    alpha = min(times[:2])
    spent = times[-1] - alpha
    return alpha, (sizes[-1] / spent if spent > 0 else float("inf"))


# ---- engines ---------------------------------------------------------------------


def run_engine(model: str, tp: int, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill and decode timings of one engine on the fixed greedy workload."""
    from engine_service.config import EngineConfig
    from engine_service.core import EngineCore
    from tandem.protocol.outputs import EngineCoreRequest
    from tandem.protocol.sampling_params import SamplingParams

    start = time.perf_counter()
    core = EngineCore(EngineConfig(
        model=model, max_model_len=1024, max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len,
        kv_cache_memory_bytes=256 * 2**20, tensor_parallel_size=tp, num_threads=threads,
        enable_prefix_caching=False,
    ))
    startup = time.perf_counter() - start
    in_all_reduce = [0.0]  # seconds rank 0 spent inside all-reduces (waits for the peer included)
    if core.executor is not None:
        comm = core.executor.comm
        plain = comm.all_reduce

        def timed(tensor: Any) -> Any:
            t0 = time.perf_counter()
            out = plain(tensor)
            in_all_reduce[0] += time.perf_counter() - t0
            return out

        comm.all_reduce = timed  # type: ignore[method-assign]
    try:
        tokens: dict[str, list[int]] = {}
        step_times: list[tuple[int, float]] = []  # (scheduled tokens, seconds)
        for rep in range(2):  # the first round warms up (oneDNN primitives, first touches)
            step_times.clear()
            in_all_reduce[0] = 0.0
            for i in range(args.batch):
                prompt = [5 + (97 * i + 13 * j) % 900 for j in range(args.prompt_len)]
                params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
                core.add_request(EngineCoreRequest(f"{rep}-{i}", prompt, params, eos_token_id=None))
                tokens[f"{rep}-{i}"] = []
            while core.has_unfinished_requests():
                if len(step_times) == 1:
                    in_all_reduce[0] = 0.0  # decode steps only
                t0 = time.perf_counter()
                outs = core.step()
                step_times.append((outs.scheduler_stats.num_running_reqs, time.perf_counter() - t0))
                for o in outs.all_outputs():
                    tokens[o.request_id] += o.new_token_ids
    finally:
        core.shutdown()
    prefill = step_times[0][1]
    decode = [t for _, t in step_times[1:]]
    return {
        "tp": tp,
        "threads_per_rank": threads,
        "startup_s": startup,
        "prefill_step_s": prefill,
        "decode_step_ms": 1e3 * statistics.median(decode),
        "decode_tokens_per_s": args.batch / statistics.median(decode),
        "decode_all_reduce_ms": 1e3 * in_all_reduce[0] / len(decode),
        "tokens": [tokens[f"1-{i}"] for i in range(args.batch)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint; default: bench-135m (made on first use)")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, 2 GPUs); default cpu")
    parser.add_argument("--threads", type=int, default=2, help="total torch threads, split over the ranks; default 2")
    parser.add_argument("--batch", type=int, default=8, help="requests; default 8")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens each; default 128")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens each; default 32")
    parser.add_argument("--iters", type=int, default=50, help="all-reduces timed per size; default 50")
    parser.add_argument("--smoke", action="store_true", help="tiny model and sizes (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt_len, args.output_len, args.iters = 2, 16, 4, 5
    model = args.model or cached_model("tiny" if args.smoke else "bench-135m")
    print(f"model {model}; device {args.device}; load average {load_average()}", flush=True)

    sizes = [2**k for k in ((12, 16, 20) if args.smoke else range(10, 27, 2))]
    backend, times = measure_all_reduce(sizes, args.iters, args.device)
    alpha, beta = fit_latency_bandwidth(sizes, times)
    print(f"\n{backend} all-reduce, 2 ranks (median of {args.iters}):")
    print(format_table(
        ["bytes", "latency us", "algbw MB/s"],
        [[s, f"{t * 1e6:.0f}", f"{s / t / 1e6:.0f}"] for s, t in zip(sizes, times, strict=True)],
    ))
    print(f"fit: alpha {alpha * 1e6:.0f} us + bytes / {beta / 1e6:.0f} MB/s")

    rows = []
    for name, hidden, layers in PROJECTED_MODELS:
        for tokens in (1, 64, 2048):
            per_call = alpha + tokens * hidden * 2 / beta  # bfloat16 activations
            rows.append([name, tokens, 2 * layers + 1, f"{(2 * layers + 1) * per_call * 1e3:.2f}"])
    print(f"\nprojected all-reduce time per step with TP=2 over {backend} (bf16 activations):")
    print(format_table(["model", "tokens in step", "all-reduces", "ms per step"], rows))

    if args.device != "cpu":
        return 0
    results = [run_engine(model, 1, args.threads, args), run_engine(model, 2, max(1, args.threads // 2), args)]
    same = results[0]["tokens"] == results[1]["tokens"]
    print(f"\nengine, {args.batch} requests x {args.prompt_len} prompt + {args.output_len} output tokens, "
          f"{args.threads} threads in total; load average {load_average()}:")
    print(format_table(
        ["TP", "threads/rank", "startup s", "prefill step s", "decode step ms", "of it in all-reduce",
         "decode tok/s"],
        [[r["tp"], r["threads_per_rank"], f"{r['startup_s']:.1f}", f"{r['prefill_step_s']:.3f}",
          f"{r['decode_step_ms']:.1f}", f"{r['decode_all_reduce_ms']:.1f}", f"{r['decode_tokens_per_s']:.0f}"]
         for r in results],
    ))
    print(f"greedy tokens TP=1 vs TP=2: {'same' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
