"""Start-up with engines that load their model slowly (issue 43).

--connect-timeout bounds only the wait for an engine that does not answer at all; an
engine that answers that it is loading (its grpc.health.v1 liveness SERVING, readiness
NOT_SERVING, GetEngineInfo UNAVAILABLE "still loading") is waited for, up to
--load-timeout, with its progress logged; an engine process that exits is reported at
once; and each failure reaches the user as one line, ``tandem: error: ...``.

The engines here are stand-ins (an in-process gRPC server, or a small Python child
serving health only): they load for as long as a test says, in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from frontend_service import engine_client
from frontend_service.engine_client import EngineConnection, EngineUnavailableError
from frontend_service.engine_group import EngineGroup
from tandem.errors import EngineStartError
from tandem.health import ServiceHealth
from tandem.supervisor import EngineProcess, EngineSupervisor, RestartPolicy
from tandem.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e_helpers import ENGINE_ARGS, child_env, free_port, serve_ports, tandem_command

pytestmark = pytest.mark.timeout(120)

CONNECT_TIMEOUT = 0.5  # seconds: far shorter than the loads below


class LoadingEngine(engine_pb2_grpc.EngineCoreServicer):
    """GetEngineInfo answers UNAVAILABLE "still loading" (as EngineServicer does) until
    ``loaded`` is set, then the engine's info."""

    def __init__(self) -> None:
        self.loaded = asyncio.Event()

    async def GetEngineInfo(
        self, request: engine_pb2.GetEngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetEngineInfoResponse:
        if not self.loaded.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading its model")
        return engine_pb2.GetEngineInfoResponse(model="stand-in", max_model_len=128, vocab_size=256)


@contextlib.asynccontextmanager
async def loading_engine(load_s: float | None) -> AsyncIterator[str]:
    """An engine stand-in on a free port, alive and loading for ``load_s`` seconds (None:
    for good), then ready; yields its address."""
    server = grpc.aio.server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    state = ServiceHealth(health_servicer, "tandem.v1.EngineCore")
    await state.loading()
    engine = LoadingEngine()
    engine_pb2_grpc.add_EngineCoreServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def load() -> None:
        if load_s is not None:
            await asyncio.sleep(load_s)
            engine.loaded.set()
            await state.ready()

    loader = asyncio.ensure_future(load())
    try:
        yield f"127.0.0.1:{port}"
    finally:
        loader.cancel()
        await server.stop(0)


def _connection(address: str) -> EngineConnection:
    return EngineConnection(address, 0, 0, lambda e, o: None, lambda e, r: None)


# ---- the frontend's side: EngineConnection.fetch_info and EngineGroup.connect ----------


def test_an_engine_loading_past_the_connect_timeout_is_waited_for_with_its_progress_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(engine_client, "LOADING_LOG_INTERVAL_S", 0.4)

    async def main() -> tuple[engine_pb2.GetEngineInfoResponse, float]:
        async with loading_engine(load_s=2.0) as address:
            engine = _connection(address)
            started = time.monotonic()
            try:
                info = await engine.fetch_info(CONNECT_TIMEOUT)
            finally:
                await engine.channel.close()
            return info, time.monotonic() - started

    with caplog.at_level(logging.INFO, logger=engine_client.__name__):
        info, waited = asyncio.run(main())
    assert info.max_model_len == 128
    assert waited >= 2.0  # four connect timeouts: the loading answers extended the wait
    messages = [r.getMessage() for r in caplog.records]
    assert any("is up and loading its model" in m for m in messages), messages
    progress = [m for m in messages if "still loading its model (" in m]
    assert progress and all(m.startswith("engine 0 at 127.0.0.1:") for m in progress), messages
    assert any("loaded its model" in m for m in messages), messages


def test_the_load_timeout_bounds_a_load_that_never_ends() -> None:
    async def main() -> None:
        async with loading_engine(load_s=None) as address:
            engine = _connection(address)
            try:
                await engine.fetch_info(CONNECT_TIMEOUT, load_timeout=1.0)
            finally:
                await engine.channel.close()

    started = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=r"still loading its model after 1 s \(the load timeout\)"):
        asyncio.run(main())
    assert time.monotonic() - started < 10


def test_an_engine_that_does_not_answer_at_all_fails_after_the_connect_timeout() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there

    async def main() -> None:
        engine = _connection(address)
        try:
            await engine.fetch_info(CONNECT_TIMEOUT)
        finally:
            await engine.channel.close()

    started = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=rf"{address} did not answer within 0.5 s"):
        asyncio.run(main())
    assert time.monotonic() - started < 5


def test_the_group_waits_for_every_fixed_engine_that_is_loading() -> None:
    async def main() -> engine_pb2.GetEngineInfoResponse:
        async with loading_engine(load_s=1.0) as first, loading_engine(load_s=2.0) as second:
            group = EngineGroup([first, second], 0, lambda e, o: None, lambda e, r: None)
            try:
                return await group.connect("", CONNECT_TIMEOUT)
            finally:
                await group.close()

    assert asyncio.run(main()).model == "stand-in"


# ---- tandem serve's side: EngineSupervisor.wait_serving over real child processes -------

# A child that serves grpc.health.v1 on argv[1]: alive and loading for argv[2] seconds
# (negative: for good), then SERVING.
HEALTH_CHILD = textwrap.dedent("""
    import asyncio, sys
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc
    from tandem.health import ServiceHealth

    async def main() -> None:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        state = ServiceHealth(servicer, "tandem.v1.EngineCore")
        await state.loading()
        server.add_insecure_port(sys.argv[1])
        await server.start()
        load_s = float(sys.argv[2])
        if load_s >= 0:
            await asyncio.sleep(load_s)
            await state.ready()
        await server.wait_for_termination()

    asyncio.run(main())
""")


def _supervisor(*children: tuple[list[str], str]) -> EngineSupervisor:
    """``children``: (argv, the address its health answers on)."""
    engines = [EngineProcess(i, address, argv, child_env()) for i, (argv, address) in enumerate(children)]
    return EngineSupervisor(engines, RestartPolicy())


def _health_child(load_s: float) -> tuple[list[str], str]:
    address = f"127.0.0.1:{free_port()}"
    return [sys.executable, "-c", HEALTH_CHILD, address, str(load_s)], address


def _other_child(code: str) -> tuple[list[str], str]:
    """A child that serves nothing, on an address where nothing listens."""
    return [sys.executable, "-c", code], f"127.0.0.1:{free_port()}"


def _wait(supervisor: EngineSupervisor, timeout: float, load_timeout: float = 0.0) -> float:
    """Seconds wait_serving took; the children are killed after."""
    async def main() -> float:
        supervisor.start()
        started = time.monotonic()
        try:
            await supervisor.wait_serving(timeout, load_timeout)
        finally:
            supervisor.kill()
        return time.monotonic() - started

    return asyncio.run(main())


def test_serve_waits_for_engines_that_load_past_the_connect_timeout() -> None:
    # Python and grpc start in about a second: the connect timeout covers that, not the load.
    waited = _wait(_supervisor(_health_child(3.0), _health_child(4.0)), timeout=10.0)
    assert waited >= 3.0


def test_serve_gives_up_on_an_engine_still_loading_after_the_load_timeout() -> None:
    with pytest.raises(EngineStartError, match=r"engine 0 \(127.0.0.1:\d+\) alive but not SERVING after \d+ s "
                                               r"of loading \(--load-timeout 1\)"):
        _wait(_supervisor(_health_child(-1)), timeout=10.0, load_timeout=1.0)


def test_serve_gives_up_on_an_engine_that_never_answers() -> None:
    silent = _other_child("import time; time.sleep(60)")
    with pytest.raises(EngineStartError, match=r"engine 0 \(127.0.0.1:\d+\) did not answer within 1 s"):
        _wait(_supervisor(silent), timeout=1.0)


def test_serve_reports_an_engine_that_exits_while_loading_at_once() -> None:
    failing = _other_child("import sys, time; time.sleep(0.5); "
                           "sys.exit('tandem: error: --model /nowhere: no such directory')")
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="engine 0 exited with code 1: --model /nowhere: no such directory"):
        _wait(_supervisor(failing), timeout=60.0)
    assert time.monotonic() - started < 10


# ---- the command line: a failed start-up is one line, no traceback ----------------------


def _last_line_is_the_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("tandem: error: "), stderr
    return last


def test_frontend_without_an_answering_engine_fails_with_one_line(tiny_llama_dir: str) -> None:
    address = f"127.0.0.1:{free_port()}"
    args = ["frontend", "--model", tiny_llama_dir, "--engine", address, "--host", "127.0.0.1",
            "--port", str(free_port()), "--connect-timeout", str(CONNECT_TIMEOUT), "--metrics-port", "0",
            "--http-port", "0", "--admin-port", "0"]
    result = subprocess.run(tandem_command(*args), env=child_env(), capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stderr
    last = _last_line_is_the_error(result.stderr)
    assert f"cannot start the frontend: engine at {address} did not answer within 0.5 s" in last, last


def test_serve_whose_engines_serve_another_tokenizer_fails_with_one_line(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    # The frontend's copy of the checkpoint differs in one tokenizer file; '-- --model'
    # hands the engine the original: the frontend refuses it (TokenizerMismatchError).
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    with open(copy / "tokenizer_config.json", "a") as f:
        f.write("\n")
    port, engine_port = serve_ports()
    args = ["serve", "--model", str(copy), "--host", "127.0.0.1", "--port", str(port),
            "--engine-base-port", str(engine_port), "--metrics-port", "0", "--engine-metrics-base-port", "0",
            "--http-port", "0", "--", "--model", tiny_llama_dir, *ENGINE_ARGS]
    result = subprocess.run(tandem_command(*args), env=child_env(), capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stderr
    own = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("[engine 0]"))
    last = _last_line_is_the_error(own)
    assert "cannot start the frontend: engine at" in last and "tokenizer fingerprint" in last, result.stderr
