#!/usr/bin/env python
"""Offline output throughput: Tandem's EngineCore against Hugging Face transformers.

One run, one checkpoint, one workload, three systems:

1. Tandem ``EngineCore`` in-process: every request added up front, stepped to completion.
2. HF ``model.generate()`` in static batches (left padding; a batch runs until its
   longest request is done). Only the tokens each request asked for count as output;
   the raw count, padding waste included, is reported beside it. Several batch sizes
   are tried and the best is reported too.
3. HF continuous batching: the ``ContinuousBatchingManager`` behind
   ``model.generate_batch()``. ``generate_batch`` takes one ``max_new_tokens`` for all
   requests, but the manager's ``add_request`` takes one per request (that is what
   ``generate_batch`` calls underneath), so it is given exactly the engine's work.

All runs are greedy and ignore EOS, so every request produces exactly its
``max_tokens``. Model loading and a short warm-up are outside the timed sections.

    python -m benchmarks.offline_throughput                 # bench-135m, 64 requests
    python -m benchmarks.offline_throughput --smoke --json /tmp/r.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from typing import Any

from benchmarks.common import (
    Measurement,
    Roofline,
    Workload,
    cached_model,
    faster_limits,
    format_table,
    load_average,
    make_workload,
    measure_machine,
    read_model_config,
    timed,
)

SMOKE_DEFAULTS = dict(
    preset="tiny", num_requests=6, min_prompt=4, max_prompt=24, min_output=2, max_output=12,
    batch_sizes="2,4",
)  # fmt: skip
FULL_DEFAULTS = dict(
    preset="bench-135m", num_requests=64, min_prompt=32, max_prompt=512, min_output=32,
    max_output=256, batch_sizes="8,16,32,64",
)  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--smoke", action="store_true", help="Tiny model, a handful of short requests.")
    p.add_argument("--model", default=None, help="Checkpoint directory (skips make_model).")
    p.add_argument(
        "--preset", default=None, help="make_model preset (default bench-135m; tiny with --smoke)."
    )
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--min-prompt", type=int, default=None, help="Shortest prompt in tokens.")
    p.add_argument("--max-prompt", type=int, default=None, help="Longest prompt in tokens.")
    p.add_argument(
        "--min-output", type=int, default=None, help="Fewest output tokens of a request."
    )
    p.add_argument("--max-output", type=int, default=None, help="Most output tokens of a request.")
    p.add_argument(
        "--batch-sizes", default=None, help="Comma-separated static batch sizes for HF generate()."
    )
    p.add_argument("--seed", type=int, default=0, help="Workload seed.")
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)."
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=128,
        help="Tandem max_num_seqs; HF CB max_requests_per_batch.",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="Tandem token budget per step; HF CB max_batch_tokens.",
    )
    p.add_argument(
        "--cb-page-size", type=int, default=64, help="HF CB page_size (tokens per KV page)."
    )
    p.add_argument(
        "--parity-requests",
        type=int,
        default=2,
        help="Requests checked against HF generate() at batch 1.",
    )
    p.add_argument(
        "--parity-tokens",
        type=int,
        default=None,
        help="Tokens compared per parity request (default: all with --smoke, else 32).",
    )
    p.add_argument("--skip-hf", action="store_true", help="Run Tandem only.")
    p.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: no decode graphs (EngineConfig.enforce_eager)."
    )
    p.add_argument("--json", default=None, metavar="PATH", help="Write the results as JSON here.")
    args = p.parse_args(argv)
    defaults = SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.batch_sizes = sorted({int(x) for x in str(args.batch_sizes).split(",") if x.strip()})
    except ValueError:
        p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes needs at least one positive size")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.parity_tokens is None:
        args.parity_tokens = 0 if args.smoke else 32  # 0: the whole output
    return args


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---- Tandem ---------------------------------------------------------------------------------


def run_tandem(
    model_dir: str, wl: Workload, args: argparse.Namespace
) -> tuple[Measurement, list[list[int]], dict[str, Any]]:
    from engine_service.config import EngineConfig
    from engine_service.core import EngineCore
    from tandem.protocol.outputs import EngineCoreRequest
    from tandem.protocol.sampling_params import SamplingParams

    config = EngineConfig(
        model=model_dir,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
    )
    core = EngineCore(config)

    decode = {"steps": 0, "tokens": 0, "seconds": 0.0}  # steps in which every request decodes

    def drive(prompts: list[list[int]], max_tokens: list[int], tag: str) -> list[list[int]]:
        tokens: dict[str, list[int]] = {}
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
            rid = f"{tag}{i}"
            tokens[rid] = []
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            core.add_request(EngineCoreRequest(rid, prompt, params, eos_token_id=None))
        sched = core.scheduler
        while core.has_unfinished_requests():
            # Decode-only step: nothing waiting, every running request one token behind.
            decode_only = len(sched.lifecycle.waiting) == 0 and all(
                r.num_computed_tokens == r.num_tokens - 1 for r in sched.lifecycle.running
            )
            start = time.perf_counter()
            step = core.step()
            if decode_only:
                decode["steps"] += 1
                decode["tokens"] += step.num_outputs
                decode["seconds"] += time.perf_counter() - start
            for out in step.all_outputs():
                tokens[out.request_id].extend(out.new_token_ids)
        return [tokens[f"{tag}{i}"] for i in range(len(prompts))]

    drive(*_warmup_batch(wl), tag="warm")
    decode.update(steps=0, tokens=0, seconds=0.0)
    outputs, t = timed(lambda: drive(wl.prompts, wl.max_tokens, tag="r"))
    _check_lengths("tandem", outputs, wl)
    info = {
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "block_size": config.block_size,
        "num_kv_blocks": core.num_blocks,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "device": config.torch_device.type,
        "cuda_graphs": core.runner.graphs is not None,
        "dtype": str(config.torch_dtype).removeprefix("torch."),
        "attention_backend": config.resolved_attention_backend,
        "linear_backend": config.resolved_linear_backend,
        "decode_only_steps": decode["steps"],
        "decode_only_tokens": decode["tokens"],
        "decode_only_seconds": round(decode["seconds"], 3),
    }
    total = sum(len(t) for t in outputs)
    return Measurement("Tandem EngineCore", total, t.seconds, total, t.cpu_seconds), outputs, info


def _warmup_batch(wl: Workload) -> tuple[list[list[int]], list[int]]:
    """Two short requests, distinct from the workload's prompts (no prefix-cache hits)."""
    base = wl.prompts[0][:1] or [5]
    return [base * 24, base * 9], [4, 4]


def _check_lengths(system: str, outputs: list[list[int]], wl: Workload) -> None:
    bad = [i for i, (o, n) in enumerate(zip(outputs, wl.max_tokens)) if len(o) != n]
    if bad:
        i = bad[0]
        raise RuntimeError(
            f"{system}: {len(bad)} requests got the wrong number of tokens "
            f"(request {i}: {len(outputs[i])}, wanted {wl.max_tokens[i]})"
        )


# ---- Hugging Face -----------------------------------------------------------------------------


def load_hf_model(model_dir: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # ignore_eos everywhere: no token ends a sequence early.
    model.generation_config.eos_token_id = None
    return model


def _pad_id(model: Any) -> int:
    pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


def hf_generate_batch(
    model: Any, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], int]:
    """Left-padded ``generate()`` of one static batch; returns each row's new tokens."""
    import torch

    pad = _pad_id(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
        )
    new = out[:, width:]
    return new.tolist(), int(new.numel())


def run_hf_static(model: Any, wl: Workload, batch_size: int) -> tuple[Measurement, list[list[int]]]:
    def run() -> tuple[list[list[int]], int]:
        outputs: list[list[int]] = []
        raw = 0
        for start in range(0, len(wl), batch_size):
            prompts = wl.prompts[start : start + batch_size]
            wants = wl.max_tokens[start : start + batch_size]
            rows, generated = hf_generate_batch(model, prompts, max(wants))
            raw += generated
            outputs.extend(row[:n] for row, n in zip(rows, wants))
        return outputs, raw

    (outputs, raw), t = timed(run)
    _check_lengths(f"HF generate bs={batch_size}", outputs, wl)
    useful = sum(len(o) for o in outputs)
    m = Measurement(f"HF generate() bs={batch_size}", useful, t.seconds, raw, t.cpu_seconds)
    return m, outputs


def cb_configs(
    model: Any, wl: Workload, args: argparse.Namespace
) -> tuple[Any, Any, Any, dict[str, Any]]:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    page = args.cb_page_size
    # Room for every request at once (like Tandem's KV cache, which holds the whole
    # workload), plus slack for the allocator's per-request rounding.
    pages = sum(math.ceil((len(p) + n) / page) for p, n in zip(wl.prompts, wl.max_tokens))
    num_blocks = pages + len(wl) + 2
    max_requests = min(args.max_num_seqs, len(wl))
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=num_blocks,
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=max_requests,
    )
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(wl.max_tokens),
        eos_token_id=-1,
        pad_token_id=_pad_id(model),
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in wl.prompts),
        max_generated_length=max(wl.max_tokens),
        num_requests=len(wl),
    )
    info = {
        "page_size": page,
        "num_blocks": num_blocks,
        "max_batch_tokens": args.max_num_batched_tokens,
        "max_requests_per_batch": max_requests,
        "attn_implementation": model.config._attn_implementation,
        "per_request_max_new_tokens": True,
    }
    return cb, gen, hints, info


def run_hf_cb(
    model: Any, wl: Workload, args: argparse.Namespace
) -> tuple[Measurement, list[list[int]], dict[str, Any]]:
    import torch

    cb, gen, hints, info = cb_configs(model, wl, args)

    def collect(
        manager: Any, prompts: list[list[int]], max_tokens: list[int], tag: str
    ) -> list[list[int]]:
        ids = [f"{tag}{i}" for i in range(len(prompts))]
        for rid, prompt, n in zip(ids, prompts, max_tokens):
            manager.add_request(prompt, request_id=rid, max_new_tokens=n, eos_token_id=-1)
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching: the generation thread died")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(
                        f"HF continuous batching: {result.request_id}: {result.error}"
                    )
                results[result.request_id] = result
        return [list(results[rid].generated_tokens) for rid in ids]

    # no_grad, not inference_mode: the manager's thread updates tensors made here in place.
    with (
        torch.no_grad(),
        model.continuous_batching_context_manager(
            generation_config=gen,
            continuous_batching_config=cb,
            block=True,
            timeout=30,
            workload_hints=hints,
        ) as manager,
    ):
        info["attn_implementation"] = model.config._attn_implementation
        collect(manager, *_warmup_batch(wl), tag="warm")
        outputs, t = timed(lambda: collect(manager, wl.prompts, wl.max_tokens, tag="r"))
    _check_lengths("HF continuous batching", outputs, wl)
    total = sum(len(o) for o in outputs)
    m = Measurement("HF generate_batch() CB", total, t.seconds, total, t.cpu_seconds)
    return m, outputs, info


def check_parity(
    model: Any, wl: Workload, tandem: list[list[int]], num_requests: int, num_tokens: int
) -> tuple[bool, str]:
    """Tandem's greedy tokens against unpadded batch-1 HF ``generate()``."""
    checked = []
    for i in range(min(num_requests, len(wl))):
        n = wl.max_tokens[i] if num_tokens <= 0 else min(num_tokens, wl.max_tokens[i])
        rows, _ = hf_generate_batch(model, [wl.prompts[i]], n)
        want, got = rows[0][:n], tandem[i][:n]
        if want != got:
            at = next(k for k, (a, b) in enumerate(zip(want, got)) if a != b)
            return (
                False,
                f"request {i} differs at output token {at}: HF {want[at]}, Tandem {got[at]}",
            )
        checked.append(n)
    return True, f"{len(checked)} requests, {sum(checked)} tokens vs HF generate() at batch 1"


def agreement(outputs: list[list[int]], tandem: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(outputs, tandem))
    return f"{same}/{len(tandem)}"


# ---- main -------------------------------------------------------------------------------------


def _print_roofline(
    roof: Roofline, wl: Workload, tandem: Measurement, engine_info: dict[str, Any], decode_batch: int
) -> dict[str, float | None]:
    """Print the workload's CPU roofline and Tandem's share of it; returns the shares."""
    bound_s = roof.workload_seconds(wl.prompt_tokens, wl.output_tokens, decode_batch)
    lim = roof.limits
    print(
        f"roofline: fp32 matmul {lim.matmul_gflops:.0f} GFLOP/s (torch.mm {lim.matmul_gflops_torch:.0f}, "
        f"oneDNN packed {lim.matmul_gflops_onednn:.0f}, panel kernel {lim.matmul_gflops_panel:.0f}), "
        f"copy {lim.copy_gbps:.1f} GB/s; "
        f"{roof.body_flops_per_token / 1e6:.0f} + {roof.head_flops_per_token / 1e6:.0f} (LM head) "
        f"MFLOP and {roof.weight_bytes / 2**20:.0f} MiB of weights per token/step; prefill "
        f"{roof.prefill_tokens_per_s():.0f} tok/s, decode at batch {decode_batch} "
        f"{roof.decode_tokens_per_s(decode_batch):.0f} tok/s, decode at batch 1 "
        f"{roof.decode_tokens_per_s(1):.1f} tok/s"
    )
    print(
        f"roofline for this workload: {bound_s:.1f} s, i.e. {wl.output_tokens / bound_s:.0f} output "
        f"tok/s; Tandem reaches {100 * bound_s / tandem.seconds:.0f}% of it"
    )
    bound_attn_s = roof.workload_seconds_with_attention(
        [len(p) for p in wl.prompts], wl.max_tokens, decode_batch
    )
    print(
        f"roofline with attention (prefill attention FLOPs, decode KV-cache reads): {bound_attn_s:.1f} s, "
        f"i.e. {wl.output_tokens / bound_attn_s:.0f} output tok/s; Tandem reaches "
        f"{100 * bound_attn_s / tandem.seconds:.0f}% of it"
    )
    decode_fraction = None
    if engine_info["decode_only_steps"]:
        d_steps, d_tokens = engine_info["decode_only_steps"], engine_info["decode_only_tokens"]
        d_rate = d_tokens / engine_info["decode_only_seconds"]
        d_batch = d_tokens / d_steps
        d_bound = roof.decode_tokens_per_s(d_batch)
        decode_fraction = d_rate / d_bound
        print(
            f"Tandem decode: {d_steps} decode-only steps, mean batch {d_batch:.1f}, "
            f"{d_rate:.0f} tok/s against a roofline of {d_bound:.0f} tok/s at that batch: "
            f"{100 * decode_fraction:.0f}%"
        )
    return {
        "workload_seconds": bound_s,
        "tandem_fraction": bound_s / tandem.seconds,
        "workload_seconds_with_attention": bound_attn_s,
        "tandem_fraction_with_attention": bound_attn_s / tandem.seconds,
        "tandem_decode_fraction": decode_fraction,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        # Before torch is imported, so that threads torch or transformers start inherit it.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    model_dir = args.model or cached_model(args.preset)
    hf_config = read_model_config(model_dir)
    wl = make_workload(
        args.num_requests,
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        hf_config["vocab_size"],
        seed=args.seed,
    )
    log(
        f"{len(wl)} requests, {wl.prompt_tokens} prompt tokens, {wl.output_tokens} output tokens; "
        f"model {model_dir}; {threads} torch threads"
    )
    load_start = load_average()
    # The machine is measured before and after the run (CPU engines): this VM's GEMM rate
    # and bandwidth move by 20-40% within minutes, and the faster of the two readings is
    # the bound the run is held against.
    limits_before = None
    if not torch.cuda.is_available():
        log("machine limits before the run (fp32 matmul, memory copy) ...")
        limits_before = measure_machine()

    log("Tandem EngineCore ...")
    tandem, tandem_tokens, engine_info = run_tandem(model_dir, wl, args)
    gc.collect()  # the engine and its KV cache go before the HF model comes
    log(f"  {tandem.output_tokens} tokens in {tandem.seconds:.1f}s")

    static: list[Measurement] = []
    best: Measurement | None = None
    cb: Measurement | None = None
    cb_info: dict[str, Any] = {}
    parity: tuple[bool, str] | None = None
    agree: dict[str, str] = {}
    if not args.skip_hf:
        model = load_hf_model(model_dir)
        with torch.inference_mode():
            hf_generate_batch(model, *_warmup_single(wl))
        parity = check_parity(model, wl, tandem_tokens, args.parity_requests, args.parity_tokens)
        log(f"parity: {'ok' if parity[0] else 'FAILED'} ({parity[1]})")
        for bs in args.batch_sizes:
            log(f"HF generate() batch size {bs} ...")
            m, outs = run_hf_static(model, wl, bs)
            log(f"  {m.output_tokens} useful / {m.raw_tokens} raw tokens in {m.seconds:.1f}s")
            static.append(m)
            agree[m.system] = agreement(outs, tandem_tokens)
        best = max(static, key=lambda m: m.tokens_per_s)
        log("HF continuous batching ...")
        cb, cb_outs, cb_info = run_hf_cb(model, wl, args)
        log(f"  {cb.output_tokens} tokens in {cb.seconds:.1f}s")
        agree[cb.system] = agreement(cb_outs, tandem_tokens)

    # The roofline's machine model (fp32 GEMM rate, copy bandwidth) is the CPU's.
    roof = None
    if engine_info["device"] == "cpu":
        log("machine limits after the run ...")
        limits = measure_machine()
        if limits_before is not None:
            log(
                f"  GEMM {limits_before.matmul_gflops:.0f} / {limits.matmul_gflops:.0f} GFLOP/s, "
                f"copy {limits_before.copy_gbps:.1f} / {limits.copy_gbps:.1f} GB/s (before / after)"
            )
            limits = faster_limits(limits_before, limits)
        roof = Roofline.for_model(model_dir, limits)
    decode_batch = min(len(wl), args.max_num_seqs)

    rows = []
    for m in [tandem, *static]:
        rows.append(_row(m, tandem))
    if best is not None:
        rows.append(_row(best, tandem, name=f"HF generate() best ({best.system.split()[-1]})"))
    if cb is not None:
        rows.append(_row(cb, tandem))
    table = format_table(
        ["system", "output tok", "raw tok", "seconds", "output tok/s", "x Tandem", "cpu/wall"], rows
    )

    print(
        f"Offline throughput: {len(wl)} requests, prompts {args.min_prompt}-{args.max_prompt} "
        f"tokens, outputs {args.min_output}-{args.max_output} tokens (seed {args.seed}), "
        "greedy, ignore_eos"
    )
    print(
        f"model: {model_dir} ({hf_config.get('architectures', ['?'])[0]}, "
        f"{hf_config.get('num_hidden_layers')} layers, hidden {hf_config.get('hidden_size')}, "
        f"vocab {hf_config.get('vocab_size')}); Tandem in {engine_info['dtype']} on "
        f"{engine_info['device']}, Hugging Face in float32 on the CPU"
    )
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"torch threads: {threads}, cpus: {os.cpu_count()}, {platform.machine()}"
    )
    print(
        f"load average (1/5/15 min) at start: {load_start}, at end: {load_average()}; "
        "cpu/wall: process CPU seconds per second (about the thread count when uncontended)"
    )
    print(f"workload: {wl.prompt_tokens} prompt tokens, {wl.output_tokens} output tokens")
    print()
    print(table)
    print()
    print("output tok: tokens the requests asked for; raw tok: tokens generated, padding included")
    print("Tandem: " + ", ".join(f"{k}={v}" for k, v in engine_info.items()))
    shares = None
    if roof is None:
        print(
            f"roofline: not computed (its machine model is the CPU's; this engine ran on "
            f"{engine_info['device']})"
        )
    else:
        shares = _print_roofline(roof, wl, tandem, engine_info, decode_batch)
    if not args.skip_hf:
        print(
            f"HF generate(): static batches in request order, left padding, each batch runs "
            f"to its longest max_new_tokens; batch sizes {args.batch_sizes}"
        )
        print("HF CB: " + ", ".join(f"{k}={v}" for k, v in cb_info.items()))
        print(
            "HF CB gets per-request max_new_tokens through ContinuousBatchingManager.add_request "
            "(the call generate_batch() makes with one shared value)"
        )
        print(
            "requests token-identical to Tandem: " + ", ".join(f"{k} {v}" for k, v in agree.items())
        )
        assert parity is not None
        print(f"parity: {'ok' if parity[0] else 'FAILED'} ({parity[1]})")

    if args.json:
        doc = {
            "workload": wl.describe(args),
            "model": model_dir,
            "torch_threads": threads,
            "load_average": {"start": load_start, "end": load_average()},
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "tandem": {**tandem.to_dict(), "config": engine_info},
            "hf_generate": None
            if best is None
            else {"per_batch_size": [m.to_dict() for m in static], "best": best.to_dict()},
            "hf_continuous_batching": None if cb is None else {**cb.to_dict(), "config": cb_info},
            "token_agreement_with_tandem": agree,
            "parity": None if parity is None else {"ok": parity[0], "detail": parity[1]},
            "roofline": None
            if roof is None or shares is None
            else {
                "matmul_gflops": roof.limits.matmul_gflops,
                "copy_gbps": roof.limits.copy_gbps,
                "matmul_gflops_torch": roof.limits.matmul_gflops_torch,
                "matmul_gflops_onednn": roof.limits.matmul_gflops_onednn,
                "matmul_gflops_panel": roof.limits.matmul_gflops_panel,
                "flops_per_token": roof.flops_per_token,
                "body_flops_per_token": roof.body_flops_per_token,
                "weight_bytes": roof.weight_bytes,
                "decode_batch": decode_batch,
                **shares,
            },
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0 if parity is None or parity[0] else 1


def _warmup_single(wl: Workload) -> tuple[list[list[int]], int]:
    prompts, _ = _warmup_batch(wl)
    return prompts, 4


def _row(m: Measurement, tandem: Measurement, name: str | None = None) -> list[Any]:
    ratio = m.tokens_per_s / tandem.tokens_per_s if tandem.tokens_per_s > 0 else None
    return [name or m.system, m.output_tokens, m.raw_tokens, m.seconds, m.tokens_per_s,
            ratio, m.cpu_per_wall]  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
