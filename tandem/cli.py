"""The ``tandem`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from collections.abc import Callable

Handler = Callable[[argparse.Namespace], int]


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    from engine_service import make_model

    make_model.add_cli(sub)


def _add_run(sub: argparse._SubParsersAction) -> None:
    from engine_service.config import EngineConfig

    p = sub.add_parser("run", help="Offline generation in-process (no services).")
    p.add_argument("prompts", nargs="*", help="Prompts; default: a few demo prompts.")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    EngineConfig.add_cli_args(p)
    p.set_defaults(handler=_run_offline)


def _run_offline(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from engine_service.config import EngineConfig
    from engine_service.core import EngineCore
    from engine_service.make_model import demo_model_dir
    from tandem.protocol.outputs import EngineCoreRequest
    from tandem.protocol.sampling_params import SamplingParams

    if not args.model:
        args.model = demo_model_dir()
    config = EngineConfig.from_cli_args(args)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
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
        for out in core.step().outputs:
            outputs[out.request_id].extend(out.new_token_ids)
    elapsed = time.perf_counter() - start
    for i, prompt in enumerate(prompts):
        print(f"--- {prompt!r}\n{tokenizer.decode(outputs[str(i)], skip_special_tokens=True)!r}")
    total = sum(len(v) for v in outputs.values())
    print(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)")
    return 0


def _add_engine(sub: argparse._SubParsersAction) -> None:
    from engine_service import server as engine_server

    engine_server.add_cli(sub)


def _add_services(sub: argparse._SubParsersAction) -> None:
    from frontend_service import server as frontend_server
    from tandem import client, serve

    frontend_server.add_cli(sub)
    serve.add_cli(sub)
    client.add_cli(sub)


Adder = Callable[[argparse._SubParsersAction], None]
# Subcommands that import the engine (torch): present only with the `engine` extra.
ENGINE_SUBCOMMANDS: list[Adder] = [_add_make_model, _add_run, _add_engine]
# Subcommands a frontend-only install (`pip install tandem`, no torch) can run.
SUBCOMMANDS: list[Adder] = [_add_services]


def engine_installed() -> bool:
    """True when torch, and with it the engine, is importable."""
    return importlib.util.find_spec("torch") is not None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (ENGINE_SUBCOMMANDS if engine_installed() else []) + SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    handler: Handler = getattr(args, "handler", None) or args.func
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
