"""The OpenAI-compatible HTTP API: an edge beside the gRPC servicer, on the same AsyncLLM.

``protocol.py`` (request bodies and their SamplingParams), ``serving.py`` (completions and
chat on the AsyncLLM, OpenAI-shaped responses and SSE chunks), ``app.py`` (the FastAPI
app, and the one place exceptions become OpenAI error JSON and HTTP codes), ``server.py``
(uvicorn as a task of the frontend's event loop).
"""

from __future__ import annotations

import argparse
import os

DEFAULT_HTTP_PORT = 8080


def add_http_port_cli(p: argparse.ArgumentParser) -> None:
    """``--http-port`` (env ``TANDEM_HTTP_PORT``) of ``tandem frontend`` and ``tandem serve``."""
    p.add_argument(
        "--http-port", type=int, default=int(os.environ.get("TANDEM_HTTP_PORT", str(DEFAULT_HTTP_PORT))),
        help="Serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
        f"/tokenize, /detokenize, /health, /metrics) on this port of --host (env TANDEM_HTTP_PORT; "
        f"default {DEFAULT_HTTP_PORT}; 0: off).",
    )
