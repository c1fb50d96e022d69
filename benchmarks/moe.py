"""Time the mixture-of-experts MLP on CPU: reference vs the native grouped op.

    python -m benchmarks.moe [--rounds N] [--tokens 1,64] [--shapes mixtral,qwen3]

Per layer shape and token count it prints milliseconds per call (median / fastest of the
rounds; the calls alternate round by round, so a busy neighbour slows all alike) of:

- ``reference``: ``kernels.moe.fused_moe_reference`` (a loop over experts, torch GEMMs)
- ``native fp32`` / ``native int8``: ``kernels.moe.fused_moe`` on experts packed as float32
  panels / int8 panels (``ExpertWeights.pack("panel" | "panel_int8")``)
- ``dense fp32`` / ``dense int8``: a dense SwiGLU MLP with the same active parameters
  (intermediate k I) on the dense path's panel kernel (gate_up, silu_and_mul, down; the
  panels on huge pages as the engine places them)
- ``k MLPs fp32`` / ``k MLPs int8``: k dense MLPs of the expert's size one after another
  (a decode token's MoE run as k separate MLPs; the native op should not be slower)

By default each timed call follows a read of a buffer larger than the last-level cache,
as in decode, where a layer's weights are evicted by the other layers' before the next
step (``--hot``: calls back to back; the smaller weight sets then run from cache).

Routing is random (uniform logits): every expert gets about T k / E rows. The CPU, the
kernel's ISA path, the thread count and the load average are printed first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    renormalize: bool


SHAPES = {
    # Mixtral-8x7B scaled down (H 4096 -> 1024, I 14336 -> 3584), 8 experts, top-2.
    "mixtral": Shape("mixtral-like", 1024, 3584, 8, 2, True),
    # Qwen3-30B-A3B-like: many small experts (I 768), 64 experts, top-8.
    "qwen3": Shape("qwen3-moe-like", 1024, 768, 64, 8, True),
}


_FLUSH_BYTES = 128 << 20  # read between cold calls: more than any last-level cache here
_COLD_ROUNDS_PER_ROUND = 4  # cold: single calls, so more rounds


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _dense_mlp(hidden: int, inter: int, quantize: bool, gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    from kernels import cpu_ops
    from kernels.panel_linear import onto_huge_pages, pack_panels, panel_linear

    # On huge pages, as the engine places them (and as ExpertWeights.pack places the experts).
    gate_up, down = onto_huge_pages([
        pack_panels(torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5, quantize),
        pack_panels(torch.randn(hidden, inter, generator=gen) / inter**0.5, quantize),
    ])

    def run(x: torch.Tensor) -> torch.Tensor:
        return panel_linear(cpu_ops.silu_and_mul(panel_linear(x, gate_up, None)), down, None)

    return run


def _time_rounds(
    calls: dict[str, Callable[[], object]], rounds: int, budget_s: float, cold: bool
) -> dict[str, tuple[float, float]]:
    """(median, fastest) milliseconds per call of each, the calls alternated round by round
    (a neighbour's load then slows all alike). ``cold``: one call of each a round, each
    right after a read of a buffer larger than the last-level cache (as in a decode step,
    whose layers' weights do not stay in cache between steps), ``_COLD_ROUNDS_PER_ROUND``
    times ``rounds`` rounds; else calls repeat back to back, as many a round as ``budget_s``
    allows."""
    for fn in calls.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    if cold:
        flush = torch.ones(_FLUSH_BYTES // 4, dtype=torch.float32)
        for _ in range(rounds * _COLD_ROUNDS_PER_ROUND):
            for name, fn in calls.items():
                flush.sum()
                start = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - start) * 1e3)
        return {name: (statistics.median(s), min(s)) for name, s in samples.items()}
    reps: dict[str, int] = {}
    for name, fn in calls.items():
        start = time.perf_counter()
        fn()
        one = time.perf_counter() - start
        reps[name] = max(1, int(budget_s / rounds / len(calls) / max(one, 1e-6)))
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            samples[name].append((time.perf_counter() - start) * 1e3 / reps[name])
    return {name: (statistics.median(s), min(s)) for name, s in samples.items()}


def _calls(x, weights, ids, w13, w2, fp32, int8, dense, expert_mlps) -> dict[str, Callable[[], object]]:  # type: ignore[no-untyped-def]
    from kernels import moe

    return {
        "reference": lambda: moe.fused_moe_reference(x, w13, w2, weights, ids),
        "native fp32": lambda: moe.fused_moe(x, fp32, weights, ids),
        "native int8": lambda: moe.fused_moe(x, int8, weights, ids),
        "dense fp32": lambda: dense["fp32"](x),
        "dense int8": lambda: dense["int8"](x),
        f"{len(expert_mlps['fp32'])} MLPs fp32": lambda: [mlp(x) for mlp in expert_mlps["fp32"]],
        f"{len(expert_mlps['int8'])} MLPs int8": lambda: [mlp(x) for mlp in expert_mlps["int8"]],
    }


def run_shape(shape: Shape, tokens: list[int], rounds: int, budget_s: float, cold: bool) -> None:
    from kernels import moe

    gen = torch.Generator().manual_seed(0)
    h, i, e, k = shape.hidden, shape.inter, shape.experts, shape.top_k
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    fp32 = moe.ExpertWeights(w13, w2).pack("panel", keep_dense=True)
    int8 = moe.ExpertWeights(w13, w2).pack("panel_int8")
    dense = {"fp32": _dense_mlp(h, k * i, False, gen), "int8": _dense_mlp(h, k * i, True, gen)}
    expert_mlps = {kind: [_dense_mlp(h, i, kind == "int8", gen) for _ in range(k)] for kind in ("fp32", "int8")}
    print(f"\n{shape.name}: H={h} I={i} E={e} top-{k}  (weights fp32 {(w13.numel() + w2.numel()) * 4 / 2**20:.0f} MiB, "
          f"active per token {3 * h * i * k * 4 / 2**20:.1f} MiB)")
    names = ["reference", "native fp32", "native int8", "dense fp32", "dense int8", f"{k} MLPs fp32", f"{k} MLPs int8"]
    print(f"{'T':>4}  " + "  ".join(f"{n + ' ms':>20}" for n in names) + "   (median / fastest)")
    for t in tokens:
        x = torch.randn(t, h, generator=gen)
        weights, ids = moe.route(torch.randn(t, e, generator=gen), k, shape.renormalize)
        calls = _calls(x, weights, ids, w13, w2, fp32, int8, dense, expert_mlps)
        err = float((moe.fused_moe(x, fp32, weights, ids) - moe.fused_moe_reference(x, w13, w2, weights, ids)).abs().max())
        times = _time_rounds(calls, rounds, budget_s, cold)
        cells = [f"{times[n][0]:.3f} / {times[n][1]:.3f}" for n in names]
        print(f"{t:>4}  " + "  ".join(f"{c:>20}" for c in cells) + f"   fp32 max |err| {err:.1e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=6.0, help="--hot: seconds per (shape, T) for all calls")
    parser.add_argument("--tokens", default="1,64")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--hot", action="store_true", help="calls back to back (weights may stay in cache)")
    args = parser.parse_args(argv)
    from kernels import cpu_ops

    if not cpu_ops.native_available():
        print("native CPU kernels unavailable: nothing to time")
        return 0
    isa = f"{cpu_ops.cpu_isa()} ({torch.ops.tandem_cpu.panel_kernel_isa()} kernel)"
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"cpu: {cpu_name()}   isa: {isa}   threads: {torch.get_num_threads()}   load average: {load}   "
          f"{'hot (back to back)' if args.hot else 'cold (cache flushed before each call)'}")
    tokens = [int(t) for t in args.tokens.split(",")]
    for name in args.shapes.split(","):
        run_shape(SHAPES[name], tokens, args.rounds, args.budget, not args.hot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
