"""The OpenAI-compatible HTTP API: an edge beside the gRPC servicer, on the same AsyncLLM.

``protocol.py`` (request bodies and their SamplingParams), ``serving.py`` (completions and
chat on the AsyncLLM, OpenAI-shaped responses and SSE chunks), ``app.py`` (the FastAPI
app, and the one place exceptions become OpenAI error JSON and HTTP codes), ``server.py``
(uvicorn as a task of the frontend's event loop); tool calling and reasoning in chat:
``chat_tools.py`` (tools and tool_choice of a request, what its output becomes),
``tool_parsers.py`` (on ``tool_stream.py`` and ``json_scan.py``) and ``reasoning.py``
(the model's text -> tool calls, reasoning).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

DEFAULT_HTTP_PORT = 8080


def add_http_port_cli(p: argparse.ArgumentParser) -> None:
    """``--http-port`` (env ``TANDEM_HTTP_PORT``) of ``tandem frontend`` and ``tandem serve``."""
    p.add_argument(
        "--http-port", type=int, default=int(os.environ.get("TANDEM_HTTP_PORT", str(DEFAULT_HTTP_PORT))),
        help="Serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
        f"/tokenize, /detokenize, /health, /metrics) on this port of --host (env TANDEM_HTTP_PORT; "
        f"default {DEFAULT_HTTP_PORT}; 0: off).",
    )


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # tool_parsers.TOOL_PARSERS' names
REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1")  # reasoning.REASONING_PARSERS' names


@dataclass(frozen=True)
class ChatParsing:
    """How chat output is read: ``--tool-call-parser``, ``--reasoning-parser``."""

    # A TOOL_CALL_PARSERS name; "auto": the one the chat template's tool-call syntax
    # names (none found: tool calls stay text); "none": never parse tool calls.
    tool_call_parser: str = "auto"
    reasoning_parser: str = "none"  # a REASONING_PARSER_NAMES name; "none": no reasoning split
    enable_auto_tool_choice: bool = False  # vLLM's flag, accepted: tool_choice auto always parses

    def argv(self) -> list[str]:
        """The flags that give these settings (for frontend processes started by serve)."""
        out = ["--tool-call-parser", self.tool_call_parser]
        out += ["--reasoning-parser", self.reasoning_parser]
        if self.enable_auto_tool_choice:
            out.append("--enable-auto-tool-choice")
        return out


def add_chat_parsing_cli(p: argparse.ArgumentParser) -> None:
    """``--tool-call-parser``, ``--reasoning-parser``, ``--enable-auto-tool-choice`` of
    ``tandem frontend`` and ``tandem serve`` (env TANDEM_TOOL_CALL_PARSER, ...)."""
    env = os.environ.get
    p.add_argument(
        "--tool-call-parser", choices=("auto", "none", *TOOL_CALL_PARSERS),
        default=env("TANDEM_TOOL_CALL_PARSER", "auto"),
        help="How the OpenAI API reads tool calls in chat output when a request offers tools: hermes "
        "(<tool_call>{...}</tool_call>, Qwen), llama3_json (a bare {\"name\", \"parameters\"} "
        "object, Llama 3), mistral ([TOOL_CALLS][...]); auto: the one the chat template's syntax "
        "names; none: tool calls stay text (env TANDEM_TOOL_CALL_PARSER; default auto).",
    )
    p.add_argument(
        "--reasoning-parser", choices=("none", *REASONING_PARSER_NAMES),
        default=env("TANDEM_REASONING_PARSER", "none"),
        help="Split chat output into reasoning_content (<think>...</think>) and content: qwen3 or "
        "deepseek_r1; none: no split (env TANDEM_REASONING_PARSER; default none).",
    )
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        default=env("TANDEM_ENABLE_AUTO_TOOL_CHOICE", "0").lower() in ("1", "true", "yes", "on"),
        help="Accepted for vLLM's command lines; tool_choice auto is always on where a parser is "
        "(env TANDEM_ENABLE_AUTO_TOOL_CHOICE; default off).",
    )


def chat_parsing_from_args(args: argparse.Namespace) -> ChatParsing:
    """The settings of the flags (UsageError for an unknown name that came from the env)."""
    from tandem.errors import UsageError

    for flag, value, known in (
        ("--tool-call-parser", getattr(args, "tool_call_parser", "auto"), ("auto", "none", *TOOL_CALL_PARSERS)),
        ("--reasoning-parser", getattr(args, "reasoning_parser", "none"), ("none", *REASONING_PARSER_NAMES)),
    ):
        if value not in known:
            raise UsageError(f"{flag}: unknown parser {value!r}; one of {', '.join(known)}")
    return ChatParsing(
        tool_call_parser=getattr(args, "tool_call_parser", "auto"),
        reasoning_parser=getattr(args, "reasoning_parser", "none"),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
    )
