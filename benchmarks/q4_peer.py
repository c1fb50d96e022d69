"""4-bit GGUF files side by side: Tandem keeping the 4-bit weights vs ``llama-batched-bench``.

The job of ``llama-batched-bench -npp P -ntg G -npl B -t T -fa off`` (B sequences of P prompt
tokens, G generated each, all in one batch) on the same GGUF file on both sides, one after
the other, by turns (``benchmarks.llama_cpp_peer``'s harness: Tandem's ``EngineCore`` with B
greedy requests of random P-token prompts, ``max_tokens=G``, ``ignore_eos``). Both sides use
``--threads`` threads throughout (Tandem's adaptive thread count off, as llama.cpp has none).
Tandem runs each file in the configurations of ``--configs``:

- ``q4``: ``--quantization auto``, the default: Q4_* matrices as 4-bit panels (x quantized
  to two int8 parts per 32 columns, ~16 bits), Q8_0 / Q5_0 as int8 with their scales;
- ``q4x8``: the same with x as one int8 per 32 columns (llama.cpp's own Q8 activations);
- ``float``: ``--quantization none``, every matrix dequantized to float32 at load.

With ``float`` among the configurations, each other one's greedy tokens on the 16 chat
prompts of ``benchmarks.common.CHAT_PROMPTS`` (``--greedy-tokens`` each) are compared with
the float ones: how many prompts answer identically.

Default files: the default model as shipped (SmolLM2-135M-Instruct, Q4_1). Add a Q4_K_M file
with ``--file Q4_K_M=PATH`` (made with llama.cpp's ``llama-quantize``; ``../shared/FIELD-NOTES.md``
says how to build it and ``llama-batched-bench``)::

    python -m benchmarks.q4_peer --llama-bench .../llama-batched-bench \\
        --file Q4_K_M=SmolLM2-135M-Instruct.Q4_K_M.gguf --batch-sizes 1,64
    python -m benchmarks.q4_peer --batch-sizes 1 --gen-len 8 --repeats 1   # Tandem only (smoke)
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys

import torch

from benchmarks.common import CHAT_PROMPTS, format_table, load_average
from benchmarks.llama_cpp_peer import Rates, _cpu_name, greedy_tokens, llama_rates, tandem_rates
from engine_service.config import EngineConfig
from engine_service.core import EngineCore

CONFIGS = {"q4": ("auto", 16), "q4x8": ("auto", 8), "float": ("none", 16)}


def weight_kinds(core: EngineCore) -> str:
    """How the model's linear weights are stored, e.g. "4-bit 60, int8 61, float32 0"."""
    from engine_service.models.decoder import FusedLinear
    from kernels.panel_linear import PanelWeight

    model = core.model
    packed = [m.packed_weight for m in model.modules() if isinstance(m, FusedLinear)] + [model.lm_head_packed]
    names = {torch.uint8: "4-bit", torch.int8: "int8", torch.float32: "float32"}
    counts = collections.Counter(names.get(p.panels.dtype, "?") if isinstance(p, PanelWeight) else "other"
                                 for p in packed)
    head = model.lm_head_packed
    head_kind = names.get(head.panels.dtype, "?") if isinstance(head, PanelWeight) else "other"
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())) + f" (LM head {head_kind})"


def same_greedy(cores: dict[str, EngineCore], path: str, kind: str, gen_len: int) -> list[str]:
    """Each configuration's greedy tokens on ``CHAT_PROMPTS`` against the float one's: a line
    each, how many prompts answer identically."""
    from transformers import AutoTokenizer

    from kernels.int4_linear import int4_x_bits
    from tandem.model_source import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(path))
    answers = {}
    for name, core in cores.items():
        int4_x_bits(CONFIGS[name][1])
        answers[name] = greedy_tokens(core, tokenizer, gen_len, CHAT_PROMPTS)
    lines = []
    for name, got in answers.items():
        if name != "float":
            same = sum(a == b for a, b in zip(got, answers["float"], strict=True))
            lines.append(f"greedy, Tandem {kind} {name} vs float (dequantized at load): {same}/{len(got)} chat prompts "
                         f"identical over {gen_len} tokens")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bench", default="", help="path of llama-batched-bench; empty: Tandem only")
    p.add_argument("--file", action="append", default=[], metavar="KIND=PATH",
                   help="a GGUF file to run (repeatable); the default model's Q4_1 file is always first")
    p.add_argument("--configs", default="q4,float", help=f"Tandem configurations, of {', '.join(CONFIGS)} "
                   "(default q4,float)")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    p.add_argument("--greedy-tokens", type=int, default=24,
                   help="tokens per chat prompt in the greedy comparison with float (0: none; default 24)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per cell, the sides by turns; the best of each is kept (default 2)")
    args = p.parse_args(argv)
    from kernels.int4_linear import int4_x_bits
    from tandem.model_source import default_model_file

    files = {"Q4_1": default_model_file()}
    for spec in args.file:
        kind, _, path = spec.partition("=")
        files[kind] = path
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    configs = args.configs.split(",")
    cpu = _cpu_name()
    print(f"CPU: {cpu}; load before: {load_average()}", flush=True)
    header = ["", "batch", "prompt tok/s", "gen tok/s", "ms/step", "gen vs llama.cpp"]
    rows: list[list[object]] = []
    greedy: list[str] = []
    for kind, path in files.items():
        cores = {}
        for name in configs:
            quantization, _ = CONFIGS[name]
            cores[name] = EngineCore(EngineConfig(
                model=path, quantization=quantization, num_threads=args.threads, adaptive_threads=False,
                max_num_seqs=max(sizes),
                max_model_len=args.prompt_len + args.gen_len + 64, max_num_batched_tokens=max(2048, args.prompt_len),
            ))
            print(f"{kind} {name}: {weight_kinds(cores[name])}", flush=True)
        torch.set_num_threads(args.threads)
        if args.greedy_tokens and "float" in cores:
            greedy += same_greedy(cores, path, kind, args.greedy_tokens)
            print("\n".join(greedy[-len(cores) + 1:]), flush=True)
        for name, core in cores.items():
            int4_x_bits(CONFIGS[name][1])
            tandem_rates(core, 1, args.prompt_len, 4, seed=-1)  # first-use costs out of the timing
        for batch in sizes:
            best: dict[str, Rates] = {}
            ratios: dict[str, list[float]] = collections.defaultdict(list)
            for r in range(args.repeats):
                runs = {}
                for name, core in cores.items():
                    int4_x_bits(CONFIGS[name][1])
                    # a seed per (batch, run): no prompt of a run is in the prefix cache from an earlier one
                    runs[name] = tandem_rates(core, batch, args.prompt_len, args.gen_len, seed=1000 * batch + r)
                if args.llama_bench:
                    runs["llama.cpp"] = llama_rates(args.llama_bench, path, batch, args.prompt_len, args.gen_len,
                                                    args.threads)
                    for name in cores:
                        ratios[name].append(runs[name].generation / runs["llama.cpp"].generation)
                for name, rate in runs.items():
                    if name not in best or rate.generation > best[name].generation:
                        best[name] = rate
            block = []
            for name, rate in best.items():
                vs = ""
                if name in ratios:
                    vs = (f"{rate.generation / best['llama.cpp'].generation:.2f}x (runs "
                          + " ".join(f"{x:.2f}" for x in ratios[name]) + f", median {statistics.median(ratios[name]):.2f})")
                label = f"llama.cpp {kind}" if name == "llama.cpp" else f"Tandem {kind} {name}"
                block.append([label, batch, f"{rate.prompt:.1f}", f"{rate.generation:.1f}", f"{rate.step_ms:.2f}", vs])
            rows += block
            print(format_table(header, block), flush=True)
        del cores
    int4_x_bits(16)
    print(f"\nCPU: {cpu}; prompt {args.prompt_len}, generated {args.gen_len}, threads {args.threads}, best of "
          f"{args.repeats}, sides by turns; load after: {load_average()}")
    print(format_table(header, rows))
    print("\n".join(greedy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
