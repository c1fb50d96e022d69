"""Process hygiene of the ``tandem`` command, over real processes on the tiny model:
``serve`` refuses busy ports, ends when an engine cannot start, restarts an engine that
dies, never leaves engines behind; bad invocations print one line; the CLI starts
without torch for help and client commands; every flag states its default."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.cli import HelpFormatter, build_parser
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import ServiceProcess, child_env, serve_ports, tandem_command

pytest_plugins = ["tests.e2e_helpers"]

# Small and quick to warm up: one thread, torch attention (no kernel build), 128 tokens.
ENGINE_ARGS = ("--", "--max-model-len", "128", "--max-num-batched-tokens", "128",
               "--num-gpu-blocks-override", "64", "--num-threads", "1", "--attention-backend", "torch")
TIMEOUT = 120.0  # generous: a loaded machine may be slow to start an engine


def _run(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(tandem_command(*args), env=child_env(), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _one_error_line(stderr: str) -> str:
    """The one line a failed command prints; fails on tracebacks or several lines."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "error:" in lines[0], stderr
    return lines[0]


def _serve_args(model: str, port: int, engine_port: int, *extra: str) -> list[str]:
    return ["serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--engine-base-port", str(engine_port), "--metrics-port", "0",
            "--engine-metrics-base-port", "0", "--http-port", "0", *extra, *ENGINE_ARGS]


def _engine_pids(log: str, index: int = 0) -> list[int]:
    return [int(p) for p in re.findall(rf"engine {index} started \(pid (\d+)\)", log)]


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (reparented where nobody reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_for(condition: object, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _health(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return None


def _generate(address: str, max_tokens: int = 4) -> list[frontend_pb2.GenerateResponse]:
    request = frontend_pb2.GenerateRequest(
        prompt="hello", sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        return list(frontend_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))


# ---- the command line, no services ------------------------------------------------------


def test_version_comes_from_the_package_metadata() -> None:
    """Of the distribution pyproject.toml names (not "tandem": another project's name)."""
    with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
        name = tomllib.load(f)["project"]["name"]
    result = _run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"tandem {importlib.metadata.version(name)}"


def test_allow_download_is_deprecated_and_a_hub_id_is_still_refused() -> None:
    """Nothing is ever downloaded: the flag warns and changes nothing about --model."""
    result = _run("--allow-download", "run", "--model", "SomeOrg/some-model", "hi")
    assert result.returncode == 2
    assert "--allow-download (TANDEM_ALLOW_DOWNLOAD) is deprecated" in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem: error: --model SomeOrg/some-model: no such directory"), result.stderr
    assert "nothing is downloaded" in last and "Traceback" not in result.stderr, result.stderr


def test_help_and_client_commands_start_without_torch() -> None:
    code = """
import contextlib, io, sys
from tandem import cli
for argv in (["--help"], ["--version"], ["generate", "--help"], ["serve", "--help"], ["run", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        cli.main(argv)
cli.build_parser(["generate", "hello"]).parse_args(["generate", "hello"])
heavy = sorted(m for m in ("torch", "transformers", "engine_service.core") if m in sys.modules)
print(",".join(heavy) or "none")
"""
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "none"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_flag_is_described_with_its_default() -> None:
    parser = build_parser()
    commands = _subparsers(parser)
    assert set(commands) == {"serve", "generate", "engine", "frontend", "run", "make-model"}
    for name, sub in [("tandem", parser), *commands.items()]:
        assert "``" not in (sub.description or ""), f"{name}: raw markup in its description"
        formatter = HelpFormatter(name)
        for action in sub._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            flag = action.option_strings[-1]
            text = formatter._get_help_string(action) or ""
            assert action.help and action.help.strip(), f"{name} {flag}: no help"
            assert action.required or "default" in text.lower(), f"{name} {flag}: help states no default: {text!r}"
        sub.format_help()  # every %(default)s expands


@pytest.fixture(scope="module")
def not_a_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("not_a_checkpoint")
    (path / "README.md").write_text("no weights here\n")
    return str(path)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "--model", "gpt2"], "no such directory"),
        (["engine", "--model", "{empty}"], "no config.json"),
        (["frontend", "--model", "/nonexistent/model", "--engine", "127.0.0.1:1"], "no such directory"),
        (["serve", "--model", "{empty}"], "no config.json"),
        (["generate", "--max-tokens", "-5", "hello"], "--max-tokens"),
        (["engine", "--model", "{tiny}", "--max-num-seqs", "0"], "max_num_seqs"),
    ],
)
def test_bad_invocations_print_one_line(
    argv: list[str], expected: str, not_a_checkpoint: str, tiny_llama_dir: str
) -> None:
    argv = [a.format(empty=not_a_checkpoint, tiny=tiny_llama_dir) for a in argv]
    result = _run(*argv)
    assert result.returncode == 2
    assert expected in _one_error_line(result.stderr)


# ---- tandem serve over real processes ---------------------------------------------------


def test_serve_ends_at_once_with_the_error_of_an_engine_that_cannot_start(tiny_llama_dir: str) -> None:
    args = _serve_args(tiny_llama_dir, *serve_ports())
    result = _run(*args, "--block-size", "0")  # after '--': reaches the engine only
    assert result.returncode == 1
    own = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("[engine 0]"))
    assert "Traceback" not in own, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem: error: engine 0 exited with code 2") and "block_size" in last, result.stderr


@pytest.fixture(scope="module")
def serve_stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    port, engine_port = serve_ports()
    args = _serve_args(tiny_llama_dir, port, engine_port, "--restart-backoff", "0.5")
    serve = ServiceProcess.spawn("serve", args, f"127.0.0.1:{port}", tmp_path_factory.mktemp("serve"))
    try:
        serve.wait_serving(TIMEOUT)
        yield {"serve": serve, "args": args, "engine": f"127.0.0.1:{engine_port}"}
    finally:
        serve.stop(timeout=60)
        for pid in _engine_pids(serve.log()):
            _wait_for(lambda pid=pid: _gone(pid), f"engine pid {pid} to exit after serve stopped", 30)


def test_a_second_serve_on_busy_ports_fails_at_once_naming_the_port(serve_stack: dict[str, object]) -> None:
    serve = serve_stack["serve"]
    assert isinstance(serve, ServiceProcess)
    result = _run(*serve_stack["args"])  # type: ignore[arg-type]
    assert result.returncode == 1
    line = _one_error_line(result.stderr)
    assert f"port {serve.address.rsplit(':', 1)[1]}" in line and "in use" in line
    assert serve.health() == health_pb2.HealthCheckResponse.SERVING  # the first stack is untouched


def test_a_killed_engine_is_restarted_on_its_port_and_used_again(serve_stack: dict[str, object]) -> None:
    serve = serve_stack["serve"]
    assert isinstance(serve, ServiceProcess)
    first = _engine_pids(serve.log())[-1]
    os.kill(first, signal.SIGKILL)
    _wait_for(lambda: len(_engine_pids(serve.log())) >= 2 or not serve.alive, "the engine's restart")
    assert serve.alive, serve.log_tail()
    assert f"engine 0 (pid {first}) killed by SIGKILL; restarting it in 0.5 s" in serve.log()
    serving = health_pb2.HealthCheckResponse.SERVING
    _wait_for(lambda: _health(str(serve_stack["engine"])) == serving, "the restarted engine to be SERVING")
    assert _engine_pids(serve.log())[-1] != first and _gone(first)

    def generates() -> bool:
        try:
            return _generate(serve.address)[-1].finished
        except grpc.RpcError:
            return False

    _wait_for(generates, "the frontend to use the restarted engine")


def test_sigint_stops_serve_cleanly_and_its_engines(serve_stack: dict[str, object]) -> None:
    serve = serve_stack["serve"]
    assert isinstance(serve, ServiceProcess)
    pids = _engine_pids(serve.log())
    streaming = threading.Event()
    ended: list[str] = []

    def stream() -> None:
        request = frontend_pb2.GenerateRequest(
            prompt="hello", sampling_params=common_pb2.SamplingParams(max_tokens=100, ignore_eos=True))
        with grpc.insecure_channel(serve.address) as channel:
            try:
                for resp in frontend_pb2_grpc.GenerationStub(channel).Generate(request, timeout=TIMEOUT):
                    streaming.set()
                    if resp.finished:
                        ended.append("finished")
            except grpc.RpcError as exc:
                ended.append(exc.code().name)
            streaming.set()

    client = threading.Thread(target=stream)
    client.start()
    assert streaming.wait(TIMEOUT)
    serve.proc.send_signal(signal.SIGINT)  # Ctrl-C with a request running
    assert serve.proc.wait(timeout=TIMEOUT) == 0, serve.log_tail()
    client.join(TIMEOUT)
    assert ended, "the stream neither finished nor failed"
    own = "\n".join(line for line in serve.log().splitlines() if not line.startswith("[engine"))
    assert "Traceback" not in own
    _wait_for(lambda: all(_gone(p) for p in pids), "serve's engines to exit", 30)


def test_sigkill_of_serve_leaves_no_engine(tiny_llama_dir: str, tmp_path: Path) -> None:
    """Killed while its engine starts up: the engine goes with it (parent-death signal)."""
    port, engine_port = serve_ports()
    serve = ServiceProcess.spawn("serve", _serve_args(tiny_llama_dir, port, engine_port),
                                 f"127.0.0.1:{port}", tmp_path)
    try:
        _wait_for(lambda: _engine_pids(serve.log()) or not serve.alive, "serve to start its engine")
        pids: Sequence[int] = _engine_pids(serve.log())
        assert pids, serve.log_tail()
        _wait_for(lambda: not _gone(pids[0]) and os.path.exists(f"/proc/{pids[0]}"), "the engine process", 10)
        serve.kill()
        _wait_for(lambda: _gone(pids[0]), f"engine pid {pids[0]} to die with serve", 30)
    finally:
        serve.kill()
