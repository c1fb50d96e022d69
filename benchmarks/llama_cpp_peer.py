"""Batched decode side by side with llama.cpp: Tandem's engine vs ``llama-batched-bench``.

The shape of ``llama-batched-bench -npp P -ntg G -npl B``: B sequences of P prompt
tokens each, G tokens generated per sequence, all in one batch. llama.cpp prints the
prompt-processing rate (S_PP), the generation rate (S_TG = B*G / generation time) and
the whole job's rate. Tandem does the same job on its ``EngineCore``: B greedy requests
with random P-token prompts and ``max_tokens=G`` (``ignore_eos``); the prompt phase ends
when every request has its first token, the generation rate is the tokens of the
remaining steps over their time. Each Tandem configuration (float32, and
``--quantization int8``) is compared with the GGUF of the same checkpoint (F32, Q8_0).
The two sides run one after the other in one process tree, never at once.

Set-up (not part of Tandem's dependencies; ``../shared/FIELD-NOTES.md`` has the facts):
build ``llama-batched-bench`` from the ``llama-cpp-python`` sdist's vendored llama.cpp
(``cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
-DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-batched-bench``) and
convert the checkpoint with its ``convert_hf_to_gguf.py --outtype f32|q8_0``.

    python -m benchmarks.llama_cpp_peer --model ~/.cache/tandem/bench-135m \\
        --llama-bench .../build/bin/llama-batched-bench \\
        --gguf-f32 bench-f32.gguf --gguf-q8 bench-q8_0.gguf --batch-sizes 1,64
    python -m benchmarks.llama_cpp_peer             # Tandem only, tiny model (smoke)

``--real`` runs real weights instead, the same GGUF files on both sides: the default model
as shipped (SmolLM2-135M-Instruct, Q4_1) and F32 and Q8_0 files of the same weights written
with ``engine_service.models.gguf_convert``. Tandem loads each file itself (F32 and Q4_1 as
float32; Q8_0 through the int8 kernel with the file's own scales), and with
``--llama-simple`` the F32 file's greedy answers to chat prompts are compared::

    python -m benchmarks.llama_cpp_peer --real --llama-bench .../llama-batched-bench \
        --llama-simple .../llama-simple
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import format_table, load_average
from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams


@dataclass
class Rates:
    """Tokens per second of one batched job."""

    prompt: float  # prompt tokens / prompt phase seconds
    generation: float  # generated tokens / generation phase seconds
    total: float  # (prompt + generated tokens) / job seconds
    step_ms: float  # generation phase: mean ms per step


def tandem_rates(core: EngineCore, batch: int, prompt_len: int, gen_len: int, seed: int) -> Rates:
    rng = random.Random(seed)
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=gen_len, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        core.add_request(EngineCoreRequest(f"b{batch}-{seed}-{i}", prompt, params))
    started: set[str] = set()
    start = time.perf_counter()
    while len(started) < batch:
        started.update(o.request_id for o in core.step().all_outputs() if o.new_token_ids)
    prompt_done = time.perf_counter()
    steps = generated = 0
    while core.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in core.step().all_outputs())
        steps += 1
    end = time.perf_counter()
    gen_s = max(end - prompt_done, 1e-9)
    return Rates(
        prompt=batch * prompt_len / (prompt_done - start),
        generation=generated / gen_s,
        total=batch * (prompt_len + gen_len) / (end - start),
        step_ms=gen_s / max(steps, 1) * 1e3,
    )


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6)


def llama_rates(binary: str, gguf: str, batch: int, prompt_len: int, gen_len: int, threads: int) -> Rates:
    cmd = [binary, "-m", gguf, "-npp", str(prompt_len), "-ntg", str(gen_len), "-npl", str(batch),
           "-t", str(threads), "-fa", "off", "-c", str(batch * (prompt_len + gen_len) + 64)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        m = _ROW.match(line.strip())
        if m:
            t_tg, s_pp, s_tg, s_total = float(m.group(7)), float(m.group(6)), float(m.group(8)), float(m.group(10))
            return Rates(prompt=s_pp, generation=s_tg, total=s_total, step_ms=t_tg / gen_len * 1e3)
    raise RuntimeError(f"no result row in llama-batched-bench output:\n{out}")


def int8_accuracy(model: str, threads: int, num_prompts: int, prompt_len: int, gen_len: int) -> str:
    """int8 against float32 on the same prompts: the logit error of every prompt's first
    generated position (relative to the float32 logits' standard deviation) and greedy
    agreement (identical greedy tokens, and positions before the first difference)."""
    runs = {}
    for quant in ("none", "int8"):
        core = EngineCore(EngineConfig(model=model, quantization=quant, num_threads=threads, max_num_seqs=num_prompts,
                                       max_model_len=prompt_len + gen_len + 16))
        vocab = core.model_config.vocab_size
        rng = random.Random(1234)  # the same prompts for both
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
        params = SamplingParams(max_tokens=gen_len, ignore_eos=True, temperature=0.0, logprobs=20)
        for i, prompt in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"acc-{i}", prompt, params))
        tokens: dict[str, list[int]] = {}
        first: dict[str, dict[int, float]] = {}
        while core.has_unfinished_requests():
            for out in core.step().all_outputs():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.new_logprobs is not None and out.request_id not in first:
                    row_ids, row_lps = out.new_logprobs.token_ids[0], out.new_logprobs.logprobs[0]
                    first[out.request_id] = dict(zip(row_ids[1:], row_lps[1:], strict=True))
        runs[quant] = (tokens, first)
        del core
    (t32, f32), (t8, f8) = runs["none"], runs["int8"]
    same = sum(t32[r] == t8[r] for r in t32)
    prefix = [next((i for i, (a, b) in enumerate(zip(t32[r], t8[r], strict=True)) if a != b), gen_len) for r in t32]
    errs = [abs(f32[r][tok] - f8[r][tok]) for r in f32 for tok in f32[r] if tok in f8[r]]
    first_same = sum(t32[r][0] == t8[r][0] for r in t32)
    margins = sorted(sorted(f32[r].values())[-1] - sorted(f32[r].values())[-2] for r in f32)
    return (f"int8 vs float32, {num_prompts} random prompts x {gen_len} greedy tokens: first token equal "
            f"{first_same}/{num_prompts}, identical sequences {same}/{num_prompts}, tokens before the first "
            f"difference mean {sum(prefix) / len(prefix):.1f} of {gen_len} (min {min(prefix)}); top-20 logprob "
            f"error at the first position: mean {sum(errs) / len(errs):.4f}, max {max(errs):.4f} nats; float32's "
            f"top-1 minus top-2 logprob there: median {margins[len(margins) // 2]:.4f} nats")


# Chat prompts of the --real greedy comparisons.
REAL_PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
    "Who wrote Romeo and Juliet?", "What is the largest ocean on Earth?", "Give me a synonym for happy.",
    "What planet is known as the Red Planet?", "Explain photosynthesis in one sentence.",
]


def real_files(work_dir: str) -> dict[str, str]:
    """The default model's GGUF as shipped (Q4_1), and F32 and Q8_0 files of its weights."""
    from engine_service.models.gguf_convert import requantize_gguf
    from tandem.model_source import default_model_file

    files = {"Q4_1": default_model_file()}
    for kind in ("F32", "Q8_0"):
        path = os.path.join(work_dir, f"SmolLM2-135M-Instruct.{kind}.gguf")
        if not os.path.isfile(path):
            requantize_gguf(files["Q4_1"], path, kind)
        files[kind] = path
    return dict(sorted(files.items(), key=lambda kv: ("F32", "Q8_0", "Q4_1").index(kv[0])))


def greedy_tokens(core: EngineCore, tokenizer: Any, gen_len: int, prompts: list[str]) -> list[list[int]]:
    """The engine's greedy tokens for ``prompts`` (chat template applied), all in one batch."""
    params = SamplingParams(max_tokens=gen_len, temperature=0.0)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        core.add_request(EngineCoreRequest(f"greedy-{i}", list(ids), params, eos_token_id=tokenizer.eos_token_id))
        tokens[f"greedy-{i}"] = []
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[f"greedy-{i}"] for i in range(len(prompts))]


def greedy_answers(core: EngineCore, tokenizer: Any, gen_len: int) -> list[str]:
    """The engine's greedy answers to ``REAL_PROMPTS`` (chat template applied), as text."""
    return [tokenizer.decode(ids, skip_special_tokens=True).strip()
            for ids in greedy_tokens(core, tokenizer, gen_len, REAL_PROMPTS)]


def llama_answers(binary: str, gguf: str, tokenizer: Any, gen_len: int, threads: int) -> list[str]:
    """llama.cpp's greedy answers (``llama-simple``) to the same rendered chat prompts."""
    answers = []
    for prompt in REAL_PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        out = subprocess.run([binary, "-m", gguf, "-n", str(gen_len), text], capture_output=True, text=True,
                             check=True).stdout
        answer = out[out.find(text) + len(text):] if text in out else out
        answers.append(answer.split("<|im_end|>")[0].strip())
    return answers


def run_real(args: argparse.Namespace) -> int:
    """``--real``: both sides on the same real GGUF files."""
    from transformers import AutoTokenizer

    from tandem.model_source import resolve_model

    work_dir = args.work_dir or tempfile.mkdtemp(prefix="tandem-real-gguf-")
    os.makedirs(work_dir, exist_ok=True)
    files = real_files(work_dir)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(files["F32"]))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    cpu = _cpu_name()
    print(f"CPU: {cpu}; load before: {load_average()}", flush=True)
    rows, answers = [], {}
    for kind, path in files.items():
        core = EngineCore(EngineConfig(
            model=path, num_threads=args.threads, max_num_seqs=max(max(sizes), len(REAL_PROMPTS)),
            max_model_len=args.prompt_len + args.gen_len + 64, max_num_batched_tokens=max(2048, args.prompt_len),
        ))
        torch.set_num_threads(args.threads)
        linear = core.model.layers[0].mlp.down_proj.packed_weight
        how = f"int8, group {linear.group}" if getattr(linear, "group", 0) else "float32"
        answers[kind] = greedy_answers(core, tokenizer, args.gen_len)
        tandem_rates(core, 1, args.prompt_len, 4, seed=-1)  # first-use costs out of the timing
        for batch in sizes:
            best: dict[str, Rates] = {}
            ratios = []
            for r in range(args.repeats):
                t = tandem_rates(core, batch, args.prompt_len, args.gen_len, seed=r)
                best["tandem"] = max(best.get("tandem", t), t, key=lambda x: x.generation)
                if args.llama_bench:
                    lr = llama_rates(args.llama_bench, path, batch, args.prompt_len, args.gen_len, args.threads)
                    best["peer"] = max(best.get("peer", lr), lr, key=lambda x: x.generation)
                    ratios.append(t.generation / lr.generation)
            t = best["tandem"]
            rows.append([f"Tandem {kind} ({how})", batch, f"{t.prompt:.1f}", f"{t.generation:.1f}",
                         f"{t.step_ms:.2f}", ""])
            if "peer" in best:
                lr = best["peer"]
                rows.append([f"llama.cpp {kind}", batch, f"{lr.prompt:.1f}", f"{lr.generation:.1f}",
                             f"{lr.step_ms:.2f}", f"{t.generation / lr.generation:.2f}x (runs "
                             + " ".join(f"{x:.2f}" for x in ratios) + ")"])
            print(format_table(["", "batch", "prompt tok/s", "gen tok/s", "ms/step", "Tandem gen / peer"],
                               rows[-2 if "peer" in best else -1:]), flush=True)
        del core
    print(f"\nCPU: {cpu}; prompt {args.prompt_len}, generated {args.gen_len}, threads {args.threads}, best of "
          f"{args.repeats}; load after: {load_average()}")
    print(format_table(["", "batch", "prompt tok/s", "gen tok/s", "ms/step", "Tandem gen / peer"], rows))
    n = len(REAL_PROMPTS)
    for kind in ("Q8_0", "Q4_1"):
        same = sum(a == b for a, b in zip(answers[kind], answers["F32"]))
        print(f"Tandem {kind} vs Tandem F32, greedy answers to {n} chat prompts ({args.gen_len} tokens): "
              f"{same}/{n} identical")
    if args.llama_simple:
        theirs = llama_answers(args.llama_simple, files["F32"], tokenizer, args.gen_len, args.threads)
        same = sum(a == b for a, b in zip(answers["F32"], theirs))
        print(f"F32 greedy answers, Tandem vs llama.cpp (llama-simple): {same}/{n} identical")
        for mine, other in zip(answers["F32"], theirs):
            if mine != other:
                print(f"  Tandem:    {mine!r}\n  llama.cpp: {other!r}")
    print(f"Tandem F32's answer to {REAL_PROMPTS[0]!r}: {answers['F32'][0]!r}")
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = "AVX-512" + (" VNNI" if "avx512_vnni" in flags else "") if "avx512f" in flags else (
        "AVX2" if "avx2" in flags else "no AVX2")
    return f"{name} ({os.cpu_count()} CPUs, {isa})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint directory; default: a tiny model made here")
    p.add_argument("--llama-bench", default="", help="path of llama-batched-bench; empty: Tandem only")
    p.add_argument("--gguf-f32", default="", help="the checkpoint as F32 GGUF")
    p.add_argument("--gguf-q8", default="", help="the checkpoint as Q8_0 GGUF")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="runs per cell, the two sides by turns; the best of each is kept and the run-by-run ratios are printed (default 2)")
    p.add_argument("--configs", default="fp32,int8", help="Tandem configurations (default fp32,int8)")
    p.add_argument("--accuracy-prompts", type=int, default=16,
                   help="prompts of the int8 vs float32 accuracy check (default 16; 0: skip)")
    p.add_argument("--real", action="store_true",
                   help="real weights: the default model's GGUF files (Q4_1 as shipped, F32 and Q8_0 written "
                   "from it), the same file on both sides")
    p.add_argument("--llama-simple", default="", help="--real: path of llama-simple, for the F32 greedy answers")
    p.add_argument("--work-dir", default="", help="--real: where the F32 and Q8_0 files are written (reused)")
    args = p.parse_args(argv)
    if args.real:
        return run_real(args)
    model = args.model
    if not model:
        from engine_service.make_model import make_model

        model = make_model(tempfile.mkdtemp(prefix="tandem-llama-peer-"), "llama", "tiny", seed=0)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    peers = {"fp32": ("llama.cpp F32", args.gguf_f32), "int8": ("llama.cpp Q8_0", args.gguf_q8)}
    rows = []
    print(f"load before: {load_average()}", flush=True)
    for name in args.configs.split(","):
        core = EngineCore(EngineConfig(
            model=model, quantization="int8" if name == "int8" else "none", num_threads=args.threads,
            max_num_seqs=max(sizes), max_model_len=args.prompt_len + args.gen_len + 16,
            max_num_batched_tokens=max(2048, args.prompt_len),
        ))
        torch.set_num_threads(args.threads)
        tandem_rates(core, 1, args.prompt_len, 4, seed=-1)  # first-use costs out of the timing
        peer_name, gguf = peers[name]
        for batch in sizes:
            best: dict[str, Rates] = {}
            pair_ratios: list[float] = []  # Tandem / peer generation rate, run r against run r
            for r in range(args.repeats):
                t = tandem_rates(core, batch, args.prompt_len, args.gen_len, seed=r)
                if "tandem" not in best or t.generation > best["tandem"].generation:
                    best["tandem"] = t
                if args.llama_bench and gguf:
                    lr = llama_rates(args.llama_bench, gguf, batch, args.prompt_len, args.gen_len, args.threads)
                    if "peer" not in best or lr.generation > best["peer"].generation:
                        best["peer"] = lr
                    pair_ratios.append(t.generation / lr.generation)
            t = best["tandem"]
            rows.append([f"Tandem {name}", batch, f"{t.prompt:.1f}", f"{t.generation:.1f}", f"{t.total:.1f}",
                         f"{t.step_ms:.2f}", ""])
            if "peer" in best:
                lr = best["peer"]
                rows.append([peer_name, batch, f"{lr.prompt:.1f}", f"{lr.generation:.1f}", f"{lr.total:.1f}",
                             f"{lr.step_ms:.2f}", f"{t.generation / lr.generation:.2f}x"])
                # On a machine whose memory bandwidth drifts, each side's best can come from
                # a different period; adjacent runs share one.
                print(f"{name} batch {batch}: Tandem / peer, run by run: "
                      + " ".join(f"{x:.2f}" for x in pair_ratios)
                      + f"; median {statistics.median(pair_ratios):.2f}x", flush=True)
            print(format_table(["", "batch", "prompt tok/s", "gen tok/s", "job tok/s", "ms/step",
                                "Tandem gen / peer"], rows[-2 if "peer" in best else -1:]), flush=True)
        del core
    if args.accuracy_prompts and "int8" in args.configs.split(","):
        print(int8_accuracy(model, args.threads, args.accuracy_prompts, args.prompt_len, args.gen_len))
    print(f"\nprompt {args.prompt_len}, generated {args.gen_len}, threads {args.threads}, best of "
          f"{args.repeats}; load after: {load_average()}")
    print(format_table(["", "batch", "prompt tok/s", "gen tok/s", "job tok/s", "ms/step", "Tandem gen / peer"],
                       rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
