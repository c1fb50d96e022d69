"""Errors the ``tandem`` command reports as one line (``tandem: error: ...``), no traceback."""

from __future__ import annotations


class CLIError(Exception):
    """A user-facing failure of a command: bad input, a busy port, a child that died.

    ``exit_code`` is what the process exits with (2: usage, as argparse; 1: runtime)."""

    exit_code = 1


class UsageError(CLIError):
    """The invocation itself is wrong (a flag value, a missing file)."""

    exit_code = 2


class PortInUseError(CLIError):
    """A port the command must listen on is held by another process."""


class StartError(CLIError):
    """A service could not start: its engines never answered, kept loading past the
    load timeout, or refused it (another model, a wrong token)."""


class EngineStartError(StartError):
    """An engine process exited (or never became SERVING) during start-up."""
