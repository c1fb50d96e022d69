"""Time Tandem's Triton kernels against their PyTorch references.

    python -m benchmarks.kernels [--dtype bf16|fp16] [--only NAME]   # needs CUDA
    python -m benchmarks.kernels --smoke    # tiny cases under the Triton interpreter

On CUDA each kernel and its reference (``kernels.reference``) are timed with
``triton.testing.do_bench`` (median) over Llama-8B-like shapes (32 query / 8 KV heads of
128, hidden 4096, cache blocks of 16), batch 1-256 and context 128-8k. The table gives
achieved GB/s and TFLOP/s of the Triton kernel next to the device's measured copy
bandwidth and matmul rate, and the largest difference from the reference.

Bytes count each tensor once (K/V of every context token, queries and outputs), i.e.
the least traffic the op needs; a prefill chunk that spans several query tiles re-reads
K/V, so its GB/s can exceed what DRAM delivers. FLOPs count the causal QK^T and PV
products (4 * head_dim per visible query-key pair and head).

``--panel-int8`` (CPU, no Triton) times instead the native panel kernel's int8 weights
with per-channel scales against group scales (GGUF Q8_0, 32 k a group) on bench-135m's
shapes at 1 and 64 rows, the two alternated round by round (per call: the median and
the fastest round, the latter the steadier figure on a machine shared with other work).

Without CUDA (and without --smoke or --panel-int8) it says so and exits 0. ``--smoke`` sets
TRITON_INTERPRET=1 before importing triton, builds the full shape set (without
allocating it), then runs a few tiny cases on CPU, timed with a wall clock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OpFn = Callable[[], Any]  # runs one op once; returns the tensor to compare


@dataclass(frozen=True)
class Model:
    """The layer shape the cases are built for."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    hidden: int


REAL_MODEL = Model(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, hidden=4096)
TINY_MODEL = Model(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, hidden=64)


@dataclass(frozen=True)
class Case:
    """One timed shape. ``build`` allocates the inputs and returns (triton op, torch op)."""

    kernel: str
    label: str
    bytes: int
    flops: int
    build: Callable[[], tuple[OpFn, OpFn]]


@dataclass(frozen=True)
class Env:
    """Where and how cases run."""

    device: Any  # torch.device
    dtype: Any  # torch.dtype
    smoke: bool


# ------------------------------------------------------------------ case builders


def _attention_traffic(model: Model, seqs: list[tuple[int, int]], elem: int) -> tuple[int, int]:
    """(bytes, flops) of attention over ``seqs`` = [(query_len, prefix_len), ...]."""
    tokens = sum(q for q, _ in seqs)
    context = sum(q + p for q, p in seqs)
    kv_bytes = 2 * context * model.num_kv_heads * model.head_dim * elem
    qo_bytes = 2 * tokens * model.num_heads * model.head_dim * elem
    # Query i of a chunk over prefix p sees p + i + 1 keys.
    pairs = sum(q * p + q * (q + 1) // 2 for q, p in seqs)
    return kv_bytes + qo_bytes, 4 * pairs * model.num_heads * model.head_dim


def _build_attention(model: Model, seqs: list[tuple[int, int]], env: Env) -> tuple[OpFn, OpFn]:
    import torch

    from kernels import reference, triton_ops

    bs = model.block_size
    seq_lens = [q + p for q, p in seqs]
    blocks = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks)
    shape = (num_blocks, bs, model.num_kv_heads, model.head_dim)
    key_cache = torch.randn(shape, device=env.device, dtype=env.dtype)
    value_cache = torch.randn(shape, device=env.device, dtype=env.dtype)
    # Shuffled physical blocks, as a long-running cache would hand them out.
    physical = torch.randperm(num_blocks, device=env.device).to(torch.int32)
    table = torch.zeros(len(seqs), max(blocks), dtype=torch.int32, device=env.device)
    offset = 0
    for s, n in enumerate(blocks):
        table[s, :n] = physical[offset : offset + n]
        offset += n
    starts = [0]
    for q, _ in seqs:
        starts.append(starts[-1] + q)
    qsl = torch.tensor(starts, dtype=torch.int32, device=env.device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=env.device)
    query = torch.randn(starts[-1], model.num_heads, model.head_dim, device=env.device).to(
        env.dtype
    )
    scale = model.head_dim**-0.5
    out_t, out_r = torch.empty_like(query), torch.empty_like(query)
    args = (query, key_cache, value_cache, table, qsl, lens, scale)

    def run_triton() -> Any:
        return triton_ops.paged_attention(*args, out=out_t)

    def run_torch() -> Any:
        return reference.paged_attention(*args, out=out_r)

    return run_triton, run_torch


def attention_case(model: Model, label: str, seqs: list[tuple[int, int]], env: Env) -> Case:
    nbytes, flops = _attention_traffic(model, seqs, env.dtype.itemsize)
    return Case("paged_attention", label, nbytes, flops, lambda: _build_attention(model, seqs, env))


def _build_cache_write(model: Model, tokens: int, env: Env) -> tuple[OpFn, OpFn]:
    import torch

    from kernels import reference, triton_ops

    num_blocks = -(-tokens // model.block_size) * 4
    shape = (num_blocks, model.block_size, model.num_kv_heads, model.head_dim)
    key_cache = torch.randn(shape, device=env.device, dtype=env.dtype)
    value_cache = torch.randn(shape, device=env.device, dtype=env.dtype)
    caches = [key_cache, value_cache, key_cache.clone(), value_cache.clone()]
    kv_shape = (tokens, model.num_kv_heads, model.head_dim)
    key = torch.randn(kv_shape, device=env.device, dtype=env.dtype)
    value = torch.randn(kv_shape, device=env.device, dtype=env.dtype)
    slots = torch.randperm(num_blocks * model.block_size, device=env.device)[:tokens]

    def run_triton() -> Any:
        triton_ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
        return caches[0]

    def run_torch() -> Any:
        reference.reshape_and_cache(key, value, caches[2], caches[3], slots)
        return caches[2]

    return run_triton, run_torch


def cache_write_case(model: Model, tokens: int, env: Env) -> Case:
    nbytes = 2 * 2 * tokens * model.num_kv_heads * model.head_dim * env.dtype.itemsize
    label = f"tokens={tokens}"
    return Case(
        "reshape_and_cache", label, nbytes, 0, lambda: _build_cache_write(model, tokens, env)
    )


def _build_rms_norm(model: Model, tokens: int, env: Env) -> tuple[OpFn, OpFn]:
    import torch

    from kernels import reference, triton_ops

    x = torch.randn(tokens, model.hidden, device=env.device, dtype=env.dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(model.hidden, device=env.device, dtype=env.dtype)

    def run_triton() -> Any:
        return triton_ops.rms_norm(x, weight, 1e-6, residual)[0]

    def run_torch() -> Any:
        return reference.rms_norm(x, weight, 1e-6, residual)[0]

    return run_triton, run_torch


def rms_norm_case(model: Model, tokens: int, env: Env) -> Case:
    nbytes = 4 * tokens * model.hidden * env.dtype.itemsize  # x, residual in; out, residual out
    flops = 4 * tokens * model.hidden
    label = f"tokens={tokens} hidden={model.hidden} +residual"
    return Case("rms_norm", label, nbytes, flops, lambda: _build_rms_norm(model, tokens, env))


def _build_rotary(model: Model, tokens: int, env: Env) -> tuple[OpFn, OpFn]:
    import torch

    from kernels import reference, triton_ops

    hd = model.head_dim
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=env.device).float() / hd))
    angles = torch.outer(torch.arange(8192, device=env.device).float(), inv_freq)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [8192, head_dim] fp32
    positions = torch.randint(0, 8192, (tokens,), device=env.device)
    q = torch.randn(tokens, model.num_heads, hd, device=env.device).to(env.dtype)
    k = torch.randn(tokens, model.num_kv_heads, hd, device=env.device).to(env.dtype)
    q_t, k_t, q_r, k_r = q.clone(), k.clone(), q.clone(), k.clone()

    def run_triton() -> Any:
        triton_ops.rotary_embedding(positions, q_t, k_t, cos_sin)
        return q_t

    def run_torch() -> Any:
        reference.rotary_embedding(positions, q_r, k_r, cos_sin)
        return q_r

    return run_triton, run_torch


def rotary_case(model: Model, tokens: int, env: Env) -> Case:
    elem = env.dtype.itemsize
    heads = model.num_heads + model.num_kv_heads
    nbytes = 2 * tokens * heads * model.head_dim * elem + tokens * model.head_dim * 4
    flops = 3 * tokens * heads * model.head_dim
    label = f"tokens={tokens}"
    return Case("rotary_embedding", label, nbytes, flops, lambda: _build_rotary(model, tokens, env))


def full_cases(env: Env) -> list[Case]:
    """Realistic shapes: batch 1-256 decodes over 128-8k contexts, prefill and mixed."""
    m = REAL_MODEL
    cases = [
        attention_case(m, f"decode b={b} ctx={ctx}", [(1, ctx - 1)] * b, env)
        for b in (1, 16, 64, 256)
        for ctx in (128, 1024, 8192)
    ]
    cases += [
        attention_case(m, "prefill 1x2048", [(2048, 0)], env),
        attention_case(m, "chunk 4x512 over 1536", [(512, 1536)] * 4, env),
        attention_case(
            m, "mixed 512-chunk + 127 decodes@2k", [(512, 1024)] + [(1, 2047)] * 127, env
        ),
    ]
    for tokens in (1, 256, 4096):
        cases += [
            cache_write_case(m, tokens, env),
            rms_norm_case(m, tokens, env),
            rotary_case(m, tokens, env),
        ]
    return cases


def smoke_cases(env: Env) -> list[Case]:
    m = TINY_MODEL
    return [
        attention_case(m, "decode b=2 ctx=40", [(1, 39)] * 2, env),
        attention_case(m, "mixed chunk 20 over 9 + decode", [(20, 9), (1, 30)], env),
        cache_write_case(m, 5, env),
        rms_norm_case(m, 3, env),
        rotary_case(m, 3, env),
    ]


# ------------------------------------------------------------------ timing and report


def time_ms(fn: OpFn, env: Env) -> float:
    """Median milliseconds per call: do_bench on CUDA, a wall clock under --smoke."""
    if env.smoke:
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def device_peaks(env: Env) -> tuple[float, float]:
    """(copy GB/s counting read + write, matmul TFLOP/s in env.dtype), measured here."""
    import torch

    copy_elems, n = (1 << 16, 128) if env.smoke else (1 << 28, 8192)
    src = torch.empty(copy_elems, device=env.device, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), env)
    a = torch.randn(n, n, device=env.device).to(env.dtype)
    b = torch.randn(n, n, device=env.device).to(env.dtype)
    mm_ms = time_ms(lambda: a @ b, env)
    return 2 * src.nbytes / copy_ms / 1e6, 2 * n**3 / mm_ms / 1e9


def _is_oom(e: RuntimeError) -> bool:
    return "out of memory" in str(e).lower()


def run_case(case: Case, env: Env) -> str:
    """One table row; a reference that runs out of memory is reported, not fatal."""

    run_triton, run_torch = case.build()
    triton_out = run_triton().float()
    try:
        err = f"{(triton_out - run_torch().float()).abs().max().item():.1e}"
        torch_ms = f"{time_ms(run_torch, env):9.3f}"
    except RuntimeError as e:
        if not _is_oom(e):
            raise
        err, torch_ms = "n/a", f"{'oom':>9}"
    del triton_out
    triton_ms = time_ms(run_triton, env)
    speedup = f"{float(torch_ms) / triton_ms:6.2f}x" if torch_ms.strip() != "oom" else "     -"
    gbps = case.bytes / triton_ms / 1e6
    tflops = case.flops / triton_ms / 1e9
    return (
        f"{case.kernel:<18} {case.label:<34} {torch_ms} {triton_ms:9.3f} {speedup} "
        f"{gbps:9.4g} {tflops:8.3g} {err:>8}"
    )


def report(cases: list[Case], env: Env) -> None:
    import torch

    name = (
        torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "CPU (interpreter)"
    )
    copy_gbps, mm_tflops = device_peaks(env)
    print(f"device: {name}   dtype: {env.dtype}")
    print(f"measured copy bandwidth: {copy_gbps:.4g} GB/s   matmul: {mm_tflops:.4g} TFLOP/s")
    header = (
        f"{'kernel':<18} {'shape':<34} {'torch ms':>9} {'triton ms':>9} {'speedup':>7} "
        f"{'GB/s':>9} {'TFLOP/s':>8} {'max|diff|':>8}"
    )
    print(header)
    print("-" * len(header))
    for case in cases:
        print(run_case(case, env), flush=True)
        if env.device.type == "cuda":
            torch.cuda.empty_cache()


# (N, K) of bench-135m's int8 products: o_proj-like, down_proj, the LM head.
PANEL_INT8_SHAPES = ((576, 1536), (1536, 576), (49152, 576))


def panel_int8_report(rows: tuple[int, ...] = (1, 64), rounds: int = 25) -> None:
    """Per-channel vs grouped (Q8_0) int8 panels: milliseconds per ``panel_linear`` call
    (median / fastest of ``rounds`` rounds)."""
    import torch

    from kernels.cpu_ops import native_available
    from kernels.panel_linear import pack_panels, pack_panels_grouped, panel_linear

    if not native_available():
        print("native CPU kernels unavailable: nothing to time")
        return
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    isa = torch.ops.tandem_cpu.panel_kernel_isa()
    print(f"cpu: {cpu}   kernel: {isa}   threads: {torch.get_num_threads()}")
    print(f"{'N x K':<12} {'rows':>5} {'per-channel ms (med/min)':>25} {'grouped ms (med/min)':>21} "
          f"{'grouped/pc (med/min)':>21}")
    gen = torch.Generator().manual_seed(0)
    for n, k in PANEL_INT8_SHAPES:
        w = torch.randn(n, k, generator=gen)
        blocks = w.view(n, k // 32, 32)  # Q8_0: d = max |block| / 127, q = round(w / d)
        d = (blocks.abs().amax(dim=2) / 127).clamp_min(1e-12)
        q = torch.round(blocks / d[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
        weights = {"pc": pack_panels(w, quantize=True), "grouped": pack_panels_grouped(q, d, 32)}
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            calls = max(3, int(2e8 // (n * k * max(m, 8))))  # ~tens of ms a round
            samples: dict[str, list[float]] = {"pc": [], "grouped": []}
            for name in samples:  # warm-up
                panel_linear(x, weights[name], None)
            for _ in range(rounds):
                for name, packed in weights.items():
                    start = time.perf_counter()
                    for _ in range(calls):
                        panel_linear(x, packed, None)
                    samples[name].append((time.perf_counter() - start) * 1e3 / calls)
            pc, gr = statistics.median(samples["pc"]), statistics.median(samples["grouped"])
            pc_min, gr_min = min(samples["pc"]), min(samples["grouped"])
            print(
                f"{f'{n}x{k}':<12} {m:>5} {f'{pc:.4f} / {pc_min:.4f}':>25} {f'{gr:.4f} / {gr_min:.4f}':>21} "
                f"{f'{gr / pc:.2f} / {gr_min / pc_min:.2f}':>21}",
                flush=True,
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny cases under the interpreter")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--only", default="", help="run only kernels whose name contains this")
    parser.add_argument("--panel-int8", action="store_true", help="CPU: per-channel vs grouped int8 panels")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.panel_int8:
        panel_int8_report()
        return 0
    if args.smoke:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke must set TRITON_INTERPRET before triton is imported", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("No CUDA device: the Triton kernels cannot be timed here. Nothing to do.")
        print("(`--smoke` runs a few tiny cases under the Triton interpreter instead.)")
        return 0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.smoke:
        # Interpreter bf16 arithmetic is unreliable; fp16 keeps the smoke run meaningful.
        dtype = torch.float16
    device = torch.device("cpu" if args.smoke else "cuda")
    env = Env(device=device, dtype=dtype, smoke=args.smoke)
    planned = full_cases(env)  # shape set-up only: nothing is allocated until build()
    if args.smoke:
        print(f"{len(planned)} full-size cases set up; running the smoke set")
        cases = smoke_cases(env)
    else:
        cases = planned
    torch.manual_seed(0)
    report([c for c in cases if args.only in c.kernel], env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
