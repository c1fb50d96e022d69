"""Batch-1 decode on a GPU against its weight-read roofline, and where a step's time goes.

One sequence decodes ``--steps`` tokens through ``EngineCore.step()`` (greedy, CUDA
graphs on). The roofline of a step is one read of the weights at the GPU's measured
device-to-device copy rate (bytes read + written per second, as the issue quotes it).
Beside the step, the parts timed alone with CUDA events: the captured forward (graph
replay, batch 1) and the LM head with its argmax; ``host`` is what the step spends
beyond them (scheduling, inputs, the sampled token's read-back, outputs).

    python -m benchmarks.gpu_decode                       # llama-1b preset, made on first use
    python -m benchmarks.gpu_decode --model DIR --steps 256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

import torch

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams


def copy_rate(device: torch.device, gib: int = 2) -> float:
    """Bytes read + written per second of a large device-to-device copy, best of 5."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * gib * 2**30 / best


def gpu_ms(fn, repeats: int = 100) -> float:  # type: ignore[no-untyped-def]
    """Mean milliseconds of ``fn`` on the GPU, back to back (CUDA events)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def kernel_table(core: EngineCore, steps: int) -> list[dict[str, float | str]]:
    """GPU time per decode step of each kernel, from ``steps`` eager steps (graphs off)
    under the torch profiler; rows sorted by time, most first."""
    from torch.profiler import ProfilerActivity, profile

    graphs, core.runner.graphs = core.runner.graphs, None
    try:
        core.step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                core.step()
            torch.cuda.synchronize()
    finally:
        core.runner.graphs = graphs
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0)
        if device_us > 0:
            rows.append({"name": event.key, "us_per_step": device_us / steps, "calls_per_step": event.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint; default: the cached llama-1b preset")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--triton-gemv", action="store_true",
                   help="linears of 1-8 rows on Tandem's Triton GEMV instead of cuBLAS (EngineConfig.triton_gemv)")
    p.add_argument("--triton-split-kv", action="store_true",
                   help="small decode batches' attention split over the context (EngineConfig.triton_split_kv)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    model = args.model
    if not model:
        from engine_service.make_model import cached_model_dir

        t = time.perf_counter()
        model = cached_model_dir("llama-1b")
        print(f"checkpoint ready in {time.perf_counter() - t:.1f} s", flush=True)
    device = torch.device("cuda")
    rate = copy_rate(device)
    t = time.perf_counter()
    config = EngineConfig(
        model=model, device="cuda", dtype=args.dtype, max_num_seqs=1,
        max_model_len=args.prompt_len + args.steps + 128, gpu_memory_utilization=0.5,
        triton_gemv=args.triton_gemv, triton_split_kv=args.triton_split_kv,
    )
    core = EngineCore(config)
    load_s = time.perf_counter() - t
    # tied embeddings appear twice in a state dict; count each storage once
    seen: set[int] = set()
    weights = 0
    for tensor in core.runner.model.state_dict().values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            weights += tensor.numel() * tensor.element_size()
    roof_ms = weights / rate * 1e3

    rng = random.Random(0)
    vocab = core.model_config.vocab_size
    prompt = [rng.randrange(5, vocab) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True)

    def decode_ms(core: EngineCore, request_id: str) -> float:
        """Milliseconds per token of one sequence's steady decode."""
        core.add_request(EngineCoreRequest(request_id, prompt, params))
        for _ in range(8):  # prefill, then warm decode steps
            core.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.steps * 1e3

    step_ms = decode_ms(core, "decode-sync")
    core.abort_requests(["decode-sync"])
    while core.has_unfinished_requests():
        core.step()
    core.add_request(EngineCoreRequest("decode-0", prompt, params))
    for _ in range(8):
        core.step()

    graphs = core.runner.graphs
    graph_ms = head_ms = float("nan")
    if graphs is not None and graphs.captured:
        replay, out = graphs._graphs[1]
        graph_ms = gpu_ms(replay)
        runner_model = core.runner.model
        with torch.inference_mode():
            head_ms = gpu_ms(lambda: runner_model.compute_logits(out).argmax(-1))
    try:
        kernels = kernel_table(core, steps=20)
    except Exception as exc:  # the step numbers above stand without it
        print(f"kernel table failed: {type(exc).__name__}: {exc}")
        kernels = []
    # The same decode with async scheduling (engine_step.py's AsyncStep, its own
    # scheduler: a second engine): the host work of a step overlaps the previous forward.
    core.shutdown()
    del core
    async_core = EngineCore(dataclasses.replace(config, async_scheduling=True))
    async_ms = decode_ms(async_core, "decode-async")
    async_core.shutdown()
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": model,
        "triton_gemv": args.triton_gemv, "triton_split_kv": args.triton_split_kv,
        "weights_gb": weights / 1e9, "copy_tb_s": rate / 1e12, "load_s": load_s,
        "step_ms": step_ms, "tok_s": 1e3 / step_ms, "roofline_ms": roof_ms,
        "of_roofline": roof_ms / step_ms, "graph_ms": graph_ms, "lm_head_ms": head_ms,
        "host_ms": step_ms - graph_ms - head_ms, "async_step_ms": async_ms,
        "async_of_roofline": roof_ms / async_ms, "kernels": kernels,
    }
    kernels_used = (f"linears of 1-8 rows: {'Triton GEMV' if args.triton_gemv else 'cuBLAS'}; decode attention: "
                    f"{'split-KV' if args.triton_split_kv else 'one program per sequence and KV head'}")
    print(f"{result['gpu']} ({kernels_used}): weights {weights / 1e9:.2f} GB, copy {rate / 1e12:.2f} TB/s -> roofline "
          f"{roof_ms:.3f} ms/token; engine loaded in {load_s:.1f} s")
    print(f"batch-1 decode {step_ms:.3f} ms/token ({1e3 / step_ms:.0f} tok/s) = {roof_ms / step_ms:.0%} of the "
          f"roofline; graph replay {graph_ms:.3f} ms, LM head + argmax {head_ms:.3f} ms, "
          f"host and the rest {result['host_ms']:.3f} ms")
    print(f"with async scheduling {async_ms:.3f} ms/token ({1e3 / async_ms:.0f} tok/s) = "
          f"{roof_ms / async_ms:.0%} of the roofline")
    print("GPU kernels of one eager decode step (torch profiler; the graph holds the same kernels):")
    for row in kernels[:15]:
        print(f"  {row['us_per_step']:8.1f} us  {row['calls_per_step']:5.1f}x  {row['name'][:90]}")
    total = sum(r["us_per_step"] for r in kernels)
    calls = sum(r["calls_per_step"] for r in kernels)
    print(f"  {total:8.1f} us  {calls:5.1f}x  all kernels")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
