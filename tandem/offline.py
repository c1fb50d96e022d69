"""``tandem run``: offline generation in this process, no services."""

from __future__ import annotations

import argparse
import time

from engine_service.config import EngineConfig
from tandem.argtypes import non_negative_float, positive_int
from tandem.model_source import resolve_model


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="Offline generation in-process (no services).",
                       description="Generate text for a few prompts with an engine in this process.")
    p.add_argument("prompts", nargs="*", help="Prompts; default: a few demo prompts.")
    p.add_argument("--max-tokens", type=positive_int, default=48, help="Tokens to generate per prompt.")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="Sampling temperature; 0: greedy.")
    EngineConfig.add_cli_args(p)
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from engine_service.core import EngineCore
    from tandem.protocol.outputs import EngineCoreRequest
    from tandem.protocol.sampling_params import SamplingParams

    args.model = resolve_model(args.model)
    args.tokenizer = resolve_model(args.tokenizer) if args.tokenizer else ""
    config = EngineConfig.from_cli_args(args)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    core = EngineCore(config)
    prompts = args.prompts or [
        "The quick brown fox",
        "def fibonacci(n):",
        "Tandem serves language models",
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        core.add_request(EngineCoreRequest(str(i), ids, params, eos_token_id=tokenizer.eos_token_id))
        outputs[str(i)] = []
    start = time.perf_counter()
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            outputs[out.request_id].extend(out.new_token_ids)
    elapsed = time.perf_counter() - start
    for i, prompt in enumerate(prompts):
        print(f"--- {prompt!r}\n{tokenizer.decode(outputs[str(i)], skip_special_tokens=True)!r}")
    total = sum(len(v) for v in outputs.values())
    print(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)")
    return 0
