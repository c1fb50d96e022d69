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
from tandem.grpc_server import BindError
from tandem.security import EngineChannelSecurity, SecurityConfigError, ServerSecurity, TlsFiles

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
    telemetry.add_metrics_cli(p, default_port=8000)
    p.add_argument("--engine-metrics-base-port", type=int,
                   default=int(env("TANDEM_ENGINE_METRICS_BASE_PORT", "8001")),
                   help="Engine i serves /metrics on this port + i (0: off).")
    p.add_argument("--tls-cert", default=env("TANDEM_TLS_CERT", ""),
                   help="PEM certificate chain: the frontend serves TLS (env TANDEM_TLS_CERT; default: plain text).")
    p.add_argument("--tls-key", default=env("TANDEM_TLS_KEY", ""),
                   help="PEM private key of --tls-cert (env TANDEM_TLS_KEY; default: none).")
    p.add_argument("--admin-token", default=env("TANDEM_ADMIN_TOKEN", ""),
                   help="Bearer token for admin RPCs on the frontend's and engines' public ports (env "
                        "TANDEM_ADMIN_TOKEN, preferred; default: none, admin RPCs only on --admin-port).")
    p.add_argument("--admin-port", type=int, default=int(env("TANDEM_ADMIN_PORT", "-1")),
                   help="The frontend's 127.0.0.1-only admin listener (env TANDEM_ADMIN_PORT; default: "
                        "--port + 1; 0: off).")
    p.add_argument("--engine-token", default=env("TANDEM_ENGINE_TOKEN", ""),
                   help="Shared secret between the frontend and its engines (env TANDEM_ENGINE_TOKEN; "
                        "default: none, the engines listen on 127.0.0.1 only).")
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


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The engines' environment: tokens travel here, not in argv (visible to every user)."""
    env = dict(os.environ)
    for name, value in (("TANDEM_ADMIN_TOKEN", args.admin_token), ("TANDEM_ENGINE_TOKEN", args.engine_token)):
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    # The frontend's settings: engines run plain text on 127.0.0.1, without an admin port.
    for name in ("TANDEM_ADMIN_PORT", "TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA"):
        env.pop(name, None)
    return env


def run_cli(args: argparse.Namespace) -> int:
    if args.engines < 1:
        raise SystemExit("--engines must be >= 1")
    model = args.model
    if not model:
        from engine_service.make_model import demo_model_dir

        model = demo_model_dir()
    extra = [a for a in args.engine_args if a != "--"]
    threads = max(1, (os.cpu_count() or 1) // args.engines)
    procs = []
    addresses = []
    for i in range(args.engines):
        port = args.engine_base_port + i
        metrics_port = args.engine_metrics_base_port + i if args.engine_metrics_base_port else 0
        procs.append(subprocess.Popen(engine_command(model, port, i, extra, threads, metrics_port),
                                      env=engine_env(args)))
        addresses.append(f"127.0.0.1:{port}")
    admin_port = args.port + 1 if args.admin_port < 0 else args.admin_port
    config = FrontendConfig(model=model, engines=addresses, host=args.host, port=args.port,
                            connect_timeout=args.connect_timeout, metrics_port=args.metrics_port,
                            security=ServerSecurity(TlsFiles(args.tls_cert, args.tls_key),
                                                    admin_token=args.admin_token, admin_port=admin_port),
                            engine_channel=EngineChannelSecurity(engine_token=args.engine_token))
    admin = f", admin on 127.0.0.1:{admin_port}" if admin_port else ""
    print(f"tandem: frontend on {args.host}:{args.port}{admin}, engines on {', '.join(addresses)}", flush=True)
    tracing = telemetry.tracing_from_env("tandem-frontend")
    try:
        return asyncio.run(serve_frontend(config, tracing=tracing))
    except KeyboardInterrupt:
        return 0
    except (BindError, SecurityConfigError) as exc:
        logger.error("tandem serve: %s", exc)
        return 1
    finally:
        if tracing is not None:
            tracing.shutdown()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
