"""The tandem command: one entry point, one subcommand per job.

Subcommands are registered lazily: only the one being run imports its module, so
``tandem --help``, ``tandem --version`` and client commands start without torch.
Known failures (a bad flag value, a missing checkpoint, a busy port, an engine that
would not start) print one line, ``tandem: error: ...``, and no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

from engine_service.config import ConfigError
from tandem import DISTRIBUTION
from tandem.errors import CLIError, UsageError
from tandem.model_source import resolve_model
from tandem.protocol.model_config import ModelLoadError, check_checkpoint_dir

Handler = Callable[[argparse.Namespace], int]

DESCRIPTION = (
    "Tandem: vLLM's v1 engine as two gRPC services, a frontend (text, clients) and engines "
    "(scheduling, KV cache, model). Run 'tandem COMMAND --help' for a command's flags."
)


@dataclass(frozen=True)
class Subcommand:
    """A subcommand; ``module.add_cli(subparsers)`` registers its full parser."""

    name: str
    summary: str  # shown by ``tandem --help`` without importing ``module``
    module: str
    # What --model must hold: a whole checkpoint, its config and tokenizer only, or no check.
    checkpoint: Literal["weights", "config"] | None
    # Runs the model (torch): offered only where the `engine` extra is installed.
    engine: bool = True


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("serve", "Start N engine processes and the frontend on localhost.", "tandem.serve", "weights"),
    Subcommand("generate", "Stream text from a running frontend.", "tandem.client", None, engine=False),
    Subcommand("engine", "Run one engine service (gRPC).", "engine_service.server", "weights"),
    Subcommand("frontend", "Run the frontend service (gRPC).", "frontend_service.server", "config", engine=False),
    Subcommand("run", "Offline generation in-process (no services).", "tandem.offline", "weights"),
    Subcommand("make-model", "Write a random-weight checkpoint and tokenizer (tests, demos).",
               "engine_service.make_model", None),
)


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option whose help does not already state it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default in (None, "", argparse.SUPPRESS)
            or "%(default)" in text
            or "default" in text.lower()
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Uses HelpFormatter unless told otherwise; a usage error is one line (exit 2)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def package_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


# Deprecated: Tandem never downloads, so the flag unlocks nothing. Still accepted (scripts
# pass it), it only keeps HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE unset, and warns.
ALLOW_DOWNLOAD_ENV = "TANDEM_ALLOW_DOWNLOAD"
ALLOW_DOWNLOAD_HELP = (
    "Deprecated, does nothing useful, will be removed (env TANDEM_ALLOW_DOWNLOAD=1). --model is "
    "always a local checkpoint directory or .gguf file: a Hub id is refused with or without "
    "this flag (fetch it first: 'hf download ID --local-dir DIR'). All it does is leave "
    "HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE unset, which tandem otherwise sets to 1."
)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def engine_installed() -> bool:
    """True when torch, and with it the engine, is importable."""
    return importlib.util.find_spec("torch") is not None


def available_subcommands() -> tuple[Subcommand, ...]:
    """All subcommands with the `engine` extra; the frontend's and the client's without."""
    if engine_installed():
        return SUBCOMMANDS
    return tuple(c for c in SUBCOMMANDS if not c.engine)


def _selected(argv: Sequence[str]) -> Subcommand | None:
    """The subcommand ``argv`` names (its first token that is one), if any."""
    names = {c.name: c for c in available_subcommands()}
    return next((names[a] for a in argv if a in names), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``tandem`` parser. With ``argv``, only the subcommand it names is fully built
    (the others are listed by name and summary); without, all of them are."""
    parser = _Parser(prog="tandem", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument("--log-level", default=os.environ.get("TANDEM_LOG_LEVEL", "INFO"),
                        help="Python logging level: DEBUG, INFO, WARNING, ERROR (env TANDEM_LOG_LEVEL).")
    parser.add_argument(
        "--allow-download", action="store_true", default=_env_flag(ALLOW_DOWNLOAD_ENV),
        help=ALLOW_DOWNLOAD_HELP,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    selected = None if argv is None else _selected(argv)
    for command in available_subcommands():
        if argv is None or command is selected:
            importlib.import_module(command.module).add_cli(sub)
        else:
            sub.add_parser(command.name, help=command.summary)
    return parser


def _check_model(command: Subcommand | None, args: argparse.Namespace) -> None:
    """Resolve ``--model`` (a GGUF file, "demo", none for the default) to its checkpoint
    directory and check it holds what the command needs; a problem is one usage line."""
    if command is None or command.checkpoint is None or not hasattr(args, "model"):
        return
    named = args.model or ""
    try:
        args.model = resolve_model(named)
        check_checkpoint_dir(args.model, weights=command.checkpoint == "weights")
    except ModelLoadError as exc:
        raise UsageError(f"--model {exc}" if named else str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    allow_download = "--allow-download" in argv or _env_flag(ALLOW_DOWNLOAD_ENV)
    if not allow_download:
        # Before anything imports huggingface_hub, which reads these once.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if allow_download:
        logging.getLogger("tandem").warning(
            "--allow-download (%s) is deprecated and does nothing useful: --model must be a local "
            "checkpoint directory or .gguf file; nothing is downloaded", ALLOW_DOWNLOAD_ENV,
        )
    handler: Handler = getattr(args, "handler", None) or args.func
    try:
        _check_model(_selected(argv), args)
        return handler(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (CLIError, ConfigError, ModelLoadError, OSError) as exc:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            traceback.print_exc()
        print(f"tandem: error: {_one_line(exc)}", file=sys.stderr)
        usage = isinstance(exc, UsageError | ConfigError)
        return exc.exit_code if isinstance(exc, CLIError) else (2 if usage else 1)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
