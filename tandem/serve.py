"""``tandem serve``: the local stack as processes (N engines + one frontend)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys

from frontend_service.server import FrontendConfig, serve_frontend
from tandem import telemetry

logger = logging.getLogger(__name__)


def add_cli(sub: argparse._SubParsersAction) -> None:
    env = os.environ.get
    p = sub.add_parser("serve", help="Start N engine processes and the frontend on localhost.")
    p.add_argument("--model", default=env("TANDEM_MODEL", ""), help="Checkpoint dir; default: the demo model.")
    p.add_argument("--engines", type=int, default=int(env("TANDEM_NUM_ENGINES", "1")))
    p.add_argument("--host", default=env("TANDEM_FRONTEND_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("TANDEM_FRONTEND_PORT", "50051")))
    p.add_argument("--engine-base-port", type=int, default=int(env("TANDEM_ENGINE_BASE_PORT", "50061")),
                   help="Engine i listens on this port + i.")
    p.add_argument("--connect-timeout", type=float, default=120.0)
    p.add_argument(
        "--drain-timeout", type=float, default=float(env("TANDEM_DRAIN_TIMEOUT", "30")),
        help="On SIGTERM/SIGINT the frontend drains first (in-flight streams get this many "
        "seconds), then the engines (each as long) (env TANDEM_DRAIN_TIMEOUT; default 30).",
    )
    telemetry.add_metrics_cli(p, default_port=8000)
    p.add_argument("--engine-metrics-base-port", type=int,
                   default=int(env("TANDEM_ENGINE_METRICS_BASE_PORT", "8001")),
                   help="Engine i serves /metrics on this port + i (0: off).")
    p.add_argument("engine_args", nargs=argparse.REMAINDER,
                   help="After '--': flags passed to every engine (e.g. -- --max-num-seqs 32).")
    p.set_defaults(handler=run_cli)


def engine_command(
    model: str, port: int, index: int, extra: list[str], threads: int, metrics_port: int = 0
) -> list[str]:
    cmd = [sys.executable, "-m", "tandem.cli", "engine", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--engine-index", str(index)]
    if "--num-threads" not in extra:
        cmd += ["--num-threads", str(threads)]
    if "--metrics-port" not in extra:
        cmd += ["--metrics-port", str(metrics_port)]
    return cmd + extra


def run_cli(args: argparse.Namespace) -> int:
    if args.engines < 1:
        raise SystemExit("--engines must be >= 1")
    model = args.model
    if not model:
        from engine_service.make_model import demo_model_dir

        model = demo_model_dir()
    extra = [a for a in args.engine_args if a != "--"]
    if "--drain-timeout" not in extra:
        extra += ["--drain-timeout", str(args.drain_timeout)]
    threads = max(1, (os.cpu_count() or 1) // args.engines)
    procs = []
    addresses = []
    for i in range(args.engines):
        port = args.engine_base_port + i
        metrics_port = args.engine_metrics_base_port + i if args.engine_metrics_base_port else 0
        procs.append(subprocess.Popen(engine_command(model, port, i, extra, threads, metrics_port)))
        addresses.append(f"127.0.0.1:{port}")
    config = FrontendConfig(model=model, engines=addresses, host=args.host, port=args.port,
                            connect_timeout=args.connect_timeout, metrics_port=args.metrics_port,
                            drain_timeout=args.drain_timeout)
    print(f"tandem: frontend on {args.host}:{args.port}, engines on {', '.join(addresses)}", flush=True)
    tracing = telemetry.tracing_from_env("tandem-frontend")
    try:
        return asyncio.run(serve_frontend(config, tracing=tracing))
    except KeyboardInterrupt:
        return 0
    finally:
        if tracing is not None:
            tracing.shutdown()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=args.drain_timeout + 15)  # an engine drains before it exits
            except subprocess.TimeoutExpired:
                proc.kill()
