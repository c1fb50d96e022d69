"""Speculative decoding on real weights: batch-1 tokens/s and accepted length per proposer.

The default model (SmolLM2-135M-Instruct, its Q4_1 GGUF as shipped), greedy, two workloads:

- ``copy``: chat prompts whose answer repeats or edits text given in the prompt (fix the
  spelling of a paragraph, add a docstring to a function, repeat a list, translate the
  variable names of a snippet): where prompt lookup and suffix decoding can draft;
- ``chat``: free chat (``benchmarks.common.CHAT_PROMPTS``): little to copy.

Each of ``--repeats`` rounds starts a fresh engine per configuration (``off``, ``ngram``,
``suffix``, ``ngram-always``: ngram without the load rule that stops drafting above 16
running requests; ``draft``: a draft model, ``--draft-model``; ``--configs``), so suffix decoding's shared trie never holds an earlier
round's answers. In a round every prompt runs alone (batch 1) on each configuration in
turn, then all requests of ``--batch-sizes`` at once (distinct pairs of chat prompts), again
configuration by configuration. tokens/s counts the output tokens after each request's
first one over the time from the step that gave the last first token to the end (batch 1:
summed over the prompts); the table has each cell's median over the rounds and every
round's figure. Mean accepted length = 1 + accepted drafts per verified step (the tokens a
step that verified drafts emitted). Greedy outputs must be the same in every configuration:
the script says how many differ (0 expected).

    python -m benchmarks.spec_decode                      # batch 1 both workloads, batch 32 and 64
    python -m benchmarks.spec_decode --batch-sizes "" --max-tokens 32   # batch 1 only, short
    python -m benchmarks.spec_decode --quantization none --configs off,draft   # the float model, its
                                                          # 4-bit file as the draft
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

from benchmarks.common import CHAT_PROMPTS, format_table, load_average

COPY_PROMPTS = [
    "Fix the spelling mistakes in this paragraph and write out the corrected paragraph in full:\n\n"
    "The quick brown fox jumpd over the lazy dog. It was a sunny day and the fox was verry happy. "
    "The dog did not mind, becuase it was sleeping under a big tree near the river.",
    "Add a docstring to this Python function and return the whole function:\n\n"
    "def area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError('negative size')\n"
    "    return width * height\n",
    "Repeat this shopping list exactly, one item per line:\napples\nbananas\nbread\nmilk\neggs\ncheese\n"
    "tomatoes\nrice\nbutter\ncoffee",
    "Rename the variable x to count in this code and show the full code:\n\n"
    "x = 0\nfor item in items:\n    if item.ready:\n        x = x + 1\nprint(x)\n",
    "Copy the following sentence three times: The early bird catches the worm.",
    "Rewrite this email with the name Anna instead of Maria, keeping everything else the same:\n\n"
    "Dear Maria,\nThank you for your letter. Maria, I am glad you enjoyed the trip. "
    "We hope to see you again next summer, Maria.\nBest wishes,\nTom",
]

CONFIGS = {
    "off": "",
    "ngram": '{"method": "ngram", "num_speculative_tokens": %(k)d, "prompt_lookup_min": 2, "prompt_lookup_max": 5}',
    "suffix": '{"method": "suffix", "num_speculative_tokens": %(k)d}',
    # ngram without its load rule (disable_by_batch_size 0): what drafting costs at large batches
    "ngram-always": '{"method": "ngram", "num_speculative_tokens": %(k)d, "prompt_lookup_min": 2, '
    '"prompt_lookup_max": 5, "disable_by_batch_size": 0}',
    # a draft model (--draft-model, loaded as --draft-quantization says)
    "draft": '{"model": %(draft)s, "num_speculative_tokens": %(k)d, "quantization": "%(draft_quantization)s"}',
    "draft-4": '{"model": %(draft)s, "num_speculative_tokens": %(k)d, "quantization": "%(draft_quantization)s", '
    '"disable_by_batch_size": 4}',
}


def _batch_prompts(size: int) -> list[str]:
    """``size`` distinct free-chat prompts: pairs of CHAT_PROMPTS (no two share an answer,
    so suffix decoding's shared trie gets no answer it will be asked for again)."""
    pairs = [(a, b) for i, a in enumerate(CHAT_PROMPTS) for j, b in enumerate(CHAT_PROMPTS) if i != j]
    return [f"{a} {b}" for a, b in pairs[:: max(1, len(pairs) // size)][:size]]


def _chat_ids(tokenizer, prompt: str) -> list[int]:  # type: ignore[no-untyped-def]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run_batch(core, prompts: list[list[int]], max_tokens: int, eos: int | None, tag: str):  # type: ignore[no-untyped-def]
    """All ``prompts`` at once, greedy; -> (tokens per request, (output tokens after the
    first ones, seconds they took), verified steps, accepted drafts)."""
    from tandem.protocol.outputs import EngineCoreRequest
    from tandem.protocol.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    tokens: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        rid = f"{tag}-{i}"
        tokens[rid] = []
        core.add_request(EngineCoreRequest(rid, ids, params, eos_token_id=eos))
    started: set[str] = set()
    steps = accepted = 0
    t0 = None
    decoded = 0
    while core.has_unfinished_requests():
        outs = core.step()
        spec = outs.iteration_stats.spec_decoding if outs.iteration_stats is not None else None
        if spec is not None:
            steps += spec.num_drafts
            accepted += spec.num_accepted_tokens
        for out in outs.all_outputs():
            if out.request_id in started:
                decoded += len(out.new_token_ids)
            elif out.new_token_ids:
                started.add(out.request_id)
                decoded += len(out.new_token_ids) - 1
            tokens[out.request_id].extend(out.new_token_ids)
        if t0 is None and len(started) == len(prompts):
            t0 = time.perf_counter()
            decoded = 0
    elapsed = time.perf_counter() - t0 if t0 is not None else 0.0
    return [tokens[f"{tag}-{i}"] for i in range(len(prompts))], (decoded, elapsed), steps, accepted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="default: the default model's GGUF file")
    p.add_argument("--configs", default="off,ngram,suffix")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens, the most drafted a step (default 8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="32,64", help="batched runs (comma-separated; empty: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="rounds, the configurations by turns (default 3)")
    p.add_argument("--workloads", default="copy,chat", help="batch-1 workloads (comma-separated; empty: none)")
    p.add_argument("--quantization", default="auto", help="the target's weights (the engine's --quantization)")
    p.add_argument("--draft-model", default="", help="config draft: its checkpoint (default: the default model's "
                   "GGUF file, 4-bit: a draft for the same model dequantized, --quantization none)")
    p.add_argument("--draft-quantization", default="auto")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from benchmarks.llama_cpp_peer import _cpu_name
    from engine_service.config import EngineConfig
    from engine_service.core import EngineCore
    from tandem.model_source import default_model_file, resolve_model

    model = args.model or default_model_file()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    eos = tokenizer.eos_token_id
    texts = {"copy": COPY_PROMPTS, "chat": CHAT_PROMPTS}
    workloads = {w: [_chat_ids(tokenizer, t) for t in texts[w]] for w in args.workloads.split(",") if w.strip()}
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    names = args.configs.split(",")
    print(f"CPU: {_cpu_name()}; model {model}; load before: {load_average()}", flush=True)
    def start(name: str) -> EngineCore:
        values = {"k": args.k, "draft": json.dumps(args.draft_model or default_model_file()),
                  "draft_quantization": args.draft_quantization}
        spec = CONFIGS[name] % values if CONFIGS[name] else ""
        core = EngineCore(EngineConfig(
            model=model, num_threads=args.threads, adaptive_threads=False, max_num_seqs=max([1, *sizes]),
            max_model_len=1024, speculative_config=spec, quantization=args.quantization,
        ))
        torch.set_num_threads(args.threads)
        run_batch(core, [[1, 2, 3]], 4, eos, "warm")  # first-use costs out of the timing
        return core

    batches = {size: [_chat_ids(tokenizer, text) for text in _batch_prompts(size)] for size in sizes}
    # cell (config, workload, batch) -> rates of each round, (verified steps, accepted), tokens
    rates: dict[tuple[str, str, int], list[float]] = collections.defaultdict(list)
    spec_counts: dict[tuple[str, str, int], tuple[int, int]] = {}
    answers: dict[tuple[str, str, int], list[list[int]]] = {}
    for r in range(args.repeats):
        # A fresh engine per round: suffix decoding's shared trie holds no answer of an
        # earlier round (the same greedy prompts would find their own answers there).
        cores = {name: start(name) for name in names}
        for workload, prompts in workloads.items():
            # Prompt by prompt, every configuration in turn: the VM's drift falls on all alike.
            tally = {name: [[], 0, 0.0, 0, 0] for name in names}  # outs, decoded, seconds, steps, accepted
            for i, ids in enumerate(prompts):
                for name, core in cores.items():
                    (out,), (n, t), s, a = run_batch(core, [ids], args.max_tokens, eos, f"{workload}{i}-{r}")
                    cell_tally = tally[name]
                    cell_tally[0].append(out)
                    cell_tally[1] += n
                    cell_tally[2] += t
                    cell_tally[3] += s
                    cell_tally[4] += a
            for name, (outs, decoded, seconds, steps, accepted) in tally.items():
                cell = (name, workload, 1)
                rates[cell].append(decoded / seconds)
                spec_counts[cell], answers[cell] = (steps, accepted), outs
        for size, prompts in batches.items():
            for name, core in cores.items():
                outs, (n, t), steps, accepted = run_batch(core, prompts, args.max_tokens, eos, f"b{size}-{r}")
                cell = (name, "chat", size)
                rates[cell].append(n / t)
                spec_counts[cell], answers[cell] = (steps, accepted), outs
        for core in cores.values():
            core.shutdown()
        print(f"round {r + 1} of {args.repeats} done; load {load_average()}", flush=True)
    header = ["config", "workload", "batch", "tok/s (median)", "vs off", "runs", "mean accepted length", "tokens"]
    rows = []
    for (name, workload, batch), runs in rates.items():
        steps, accepted = spec_counts[(name, workload, batch)]
        median = statistics.median(runs)
        base = rates.get(("off", workload, batch))
        vs = f"{median / statistics.median(base):.2f}x" if base and name != "off" else ""
        rows.append([name, workload, batch, f"{median:.1f}", vs, " ".join(f"{x:.0f}" for x in runs),
                     f"{1 + accepted / steps:.2f}" if steps else "-",
                     sum(len(o) for o in answers[(name, workload, batch)])])
    rows.sort(key=lambda row: (row[2], row[1], names.index(str(row[0]))))
    print(f"\nCPU: {_cpu_name()}; greedy, max_tokens {args.max_tokens}, k {args.k}, threads {args.threads}, "
          f"{args.repeats} rounds by turns; load after: {load_average()}")
    print(format_table(header, rows))
    for (name, workload, batch), outs in answers.items():
        if name != names[0]:
            differ = sum(a != b for a, b in zip(outs, answers[(names[0], workload, batch)], strict=True))
            print(f"{name} vs {names[0]}, {workload} batch {batch}: {differ}/{len(outs)} greedy outputs differ")
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
