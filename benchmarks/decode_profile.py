"""Where each millisecond of a decode step goes, at several batch sizes, against the roofline.

For each batch size B: B requests with ``--prompt-len`` prompts are prefilled, then
``--steps`` steady decode steps run under the torch profiler. Each op's self CPU time is
put in a bucket (linear layers, LM head, attention, norms, rotary, KV write, MLP
activation, sampling, other torch ops); what the ops do not account for is Python and
framework time between them (``between ops``: the unprofiled step minus the ops'
self times, so the profiler's own per-op cost is not counted). The roofline of a step is measured in
the same run: the weights read once plus the KV cache the step attends over, at the
machine's large-copy bandwidth, or the FLOPs at its best fp32 GEMM rate, whichever is
longer (``benchmarks.common.measure_machine``).

    python -m benchmarks.decode_profile --model ~/.cache/tandem/bench-135m
    python -m benchmarks.decode_profile                      # tiny model, smoke

The profiler adds ~1-3 us per op; ``step`` is timed without it, ``profiled step`` with.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import Roofline, measure_machine
from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams

# Op name fragment -> bucket; first match wins. Names as the CPU profiler reports them.
BUCKETS = (
    ("panel_linear_argmax", "lm head"),  # greedy rows: the LM head with its argmax
    ("paged_attention", "attention"),
    ("flash_attention", "attention"),
    ("scaled_dot_product", "attention"),
    ("rms_norm", "norms"),
    ("layer_norm", "norms"),
    ("rotary", "rotary"),
    ("reshape_and_cache", "kv write"),
    ("silu", "activation"),
    ("gelu", "activation"),
    ("argmax", "sampling"),
    ("softmax", "sampling"),
    ("exponential", "sampling"),
    ("uniform", "sampling"),
    ("seeded_uniform", "sampling"),
    ("linear", "linear"),
    ("addmm", "linear"),
    ("aten::mm", "linear"),
    ("matmul", "linear"),
)
ORDER = ("linear", "lm head", "attention", "norms", "rotary", "kv write", "activation", "sampling",
         "other ops", "between ops")


def _bucket(name: str) -> str:
    for fragment, bucket in BUCKETS:
        if fragment in name:
            return bucket
    return "other ops"


def _start_batch(core: EngineCore, batch: int, prompt_len: int, steps: int) -> None:
    rng = random.Random(batch)
    vocab = core.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 16, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]
        core.add_request(EngineCoreRequest(f"p{batch}-{i}", prompt, params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()
    for _ in range(3):
        core.step()  # warm decode shapes


def measure(core: EngineCore, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Milliseconds per decode step: the wall time and each bucket (scaled to it)."""
    _start_batch(core, batch, prompt_len, steps)
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    wall = (time.perf_counter() - start) / steps * 1e3
    model = core.runner.model
    head_ms: list[float] = []
    fused: list[bool] = []  # the LM head ran as greedy_tokens (its argmax fused)

    def timed(method: Any, is_fused: bool) -> Any:
        def call(hidden: torch.Tensor) -> Any:
            t = time.perf_counter()
            try:
                return method(hidden)
            finally:
                head_ms.append((time.perf_counter() - t) * 1e3)
                fused.append(is_fused)

        return call

    model.compute_logits = timed(model.compute_logits, False)  # type: ignore[method-assign]
    model.greedy_tokens = timed(model.greedy_tokens, True)  # type: ignore[method-assign]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        profiled_wall = (time.perf_counter() - start) / steps * 1e3
    del model.compute_logits, model.greedy_tokens
    buckets: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        buckets[_bucket(event.key)] += event.self_cpu_time_total / 1e3 / steps
    # The LM head is one call per step: its own op when fused, else a linear call whose
    # time moves out of "linear".
    lm = sum(head_ms) / len(head_ms) if head_ms else 0.0
    if not any(fused):
        buckets["linear"] -= min(buckets["linear"], lm)
    buckets["lm head"] = lm
    # The profiler's own cost per op falls between ops: measure "between ops" against
    # the unprofiled step (op times scaled down only if they exceed it).
    ops = sum(buckets.values())
    scale = min(1.0, wall / ops) if ops else 1.0
    result = {k: v * scale for k, v in buckets.items()}
    result["between ops"] = max(0.0, wall - ops * scale)
    result["step"] = wall
    result["profiled step"] = profiled_wall
    core.abort_requests(list(core.scheduler.requests))
    core.take_ended_outputs()
    return result


def roofline_ms(roof: Roofline, core: EngineCore, batch: int, context: int) -> float:
    """Least time of a decode step: weights + the batch's KV cache at copy bandwidth, or
    the FLOPs at the best GEMM rate."""
    mc = core.model_config
    kv_bytes = batch * context * 2 * mc.num_layers * mc.kv_size * core.config.torch_dtype.itemsize
    read = (roof.weight_bytes + kv_bytes) / (roof.limits.copy_gbps * 1e9)
    compute = batch * roof.flops_per_token / (roof.limits.matmul_gflops * 1e9)
    return max(read, compute) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint directory; default: a tiny model made here")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    p.add_argument("--quantization", default="none", help="the engine's --quantization (default none)")
    p.add_argument("--linear-backend", default="auto", help="the engine's --linear-backend (default auto)")
    p.add_argument("--native-decode", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's --native-decode (default on; off: the per-op buckets of the Python "
                   "layer loop, on: the layers are one op, 'other ops')")
    args = p.parse_args(argv)
    model = args.model
    if not model:
        from engine_service.make_model import make_model

        model = make_model(tempfile.mkdtemp(prefix="tandem-decode-profile-"), "llama", "tiny", seed=0)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    core = EngineCore(EngineConfig(
        model=model, max_model_len=max(1024, args.prompt_len + 2 * args.steps + 32), max_num_seqs=max(sizes),
        num_threads=args.threads, max_num_batched_tokens=max(2048, args.prompt_len * 4),
        quantization=args.quantization, linear_backend=args.linear_backend, native_decode=args.native_decode,
    ))
    limits = measure_machine()
    roof = Roofline.for_model(model, limits, bytes_per_param=1 if args.quantization == "int8" else 4)
    rows = {b: measure(core, b, args.prompt_len, args.steps) for b in sizes}
    context = args.prompt_len + args.steps // 2 + 3
    print(f"model {model}; threads {torch.get_num_threads()}; machine: copy {limits.copy_gbps:.1f} GB/s, "
          f"GEMM {limits.matmul_gflops:.0f} GFLOP/s; weights {roof.weight_bytes / 2**20:.0f} MiB")
    print(f"ms per decode step (mean of {args.steps}; op buckets from the profiled run)")
    print(f"{'':<14}" + "".join(f"{f'batch {b}':>12}" for b in sizes))
    for name in ORDER:
        print(f"{name:<14}" + "".join(f"{rows[b].get(name, 0.0):>12.2f}" for b in sizes))
    print(f"{'step':<14}" + "".join(f"{rows[b]['step']:>12.2f}" for b in sizes))
    print(f"{'profiled step':<14}" + "".join(f"{rows[b]['profiled step']:>12.2f}" for b in sizes))
    bounds = {b: roofline_ms(roof, core, b, context) for b in sizes}
    print(f"{'roofline':<14}" + "".join(f"{bounds[b]:>12.2f}" for b in sizes))
    print(f"{'of roofline':<14}" + "".join(f"{bounds[b] / rows[b]['step']:>11.0%} " for b in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
