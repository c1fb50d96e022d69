"""``tandem serve --frontends 2``: two frontend processes share the gRPC and HTTP ports,
every stream is answered as with one frontend, /metrics counts both, and a second serve
on the same port is still refused."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from benchmarks.split_cost import cmdline, descendants
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import (
    ENGINE_ARGS,
    START_TIMEOUT,
    ServiceProcess,
    child_env,
    free_port,
    tandem_command,
)

CALL_TIMEOUT = 120.0
NUM_CALLS = 8


def _cmdline(pid: int) -> str:
    return " ".join(cmdline(pid))


def _generate(address: str, prompt: list[int]) -> list[int]:
    """One greedy stream on a connection of its own (so the kernel may pick either frontend)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)
        params = common_pb2.SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=common_pb2.OUTPUT_KIND_DELTA
        )
        request = frontend_pb2.GenerateRequest(
            prompt_token_ids=frontend_pb2.TokenIds(token_ids=prompt), sampling_params=params
        )
        return [t for r in stub.Generate(request, timeout=CALL_TIMEOUT) for t in r.outputs[0].token_ids]


def _serve(model: str, frontends: int, log_dir: Path) -> tuple[ServiceProcess, int, int]:
    """``tandem serve --frontends N``, SERVING: the process, its HTTP and metrics ports."""
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    args = ["serve", "--model", model, "--frontends", str(frontends), "--port", str(port),
            "--http-port", str(http_port), "--metrics-port", str(metrics_port), "--admin-port", "0",
            "--engine-base-port", str(free_port()), "--engine-metrics-base-port", "0", "--", *ENGINE_ARGS]
    serve = ServiceProcess.spawn("serve", args, f"127.0.0.1:{port}", log_dir)
    serve.wait_serving(2 * START_TIMEOUT)
    return serve, http_port, metrics_port


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def two_frontends(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    serve, http_port, metrics_port = _serve(tiny_llama_dir, 2, tmp_path_factory.mktemp("frontends"))
    try:
        yield serve, http_port, metrics_port
    finally:
        serve.stop(timeout=90)


def test_two_frontends_answer_every_stream_alike(two_frontends, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    serve, http_port, metrics_port = two_frontends
    children = [_cmdline(p) for p in descendants(serve.proc.pid)]
    assert sum(" frontend " in c and "--reuse-port" in c for c in children) == 1, children
    prompts = [[5 + i, 6, 7, 8, 9 + i] for i in range(NUM_CALLS // 2)] * 2
    outputs = [_generate(serve.address, p) for p in prompts]
    half = NUM_CALLS // 2
    assert outputs[:half] == outputs[half:]  # the same prompt, the same tokens, whichever frontend
    assert all(len(o) == 12 for o in outputs)
    # The OpenAI API on the shared HTTP port.
    body = json.dumps({"prompt": prompts[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                     {"content-type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=CALL_TIMEOUT).read())
    assert reply["choices"][0]["token_ids"] == outputs[0]
    # /metrics counts the requests of both processes.
    deadline = time.monotonic() + 30
    while _metric(metrics_port, 'tandem:request_success_total{finished_reason="length"}') < NUM_CALLS + 1:
        assert time.monotonic() < deadline, "request_success_total never reached every request"
        time.sleep(0.2)
    assert _metric(metrics_port, 'tandem:request_success_total{finished_reason="length"}') == NUM_CALLS + 1


def test_a_second_serve_on_the_same_port_is_refused(two_frontends, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    serve, _, _ = two_frontends
    port = serve.address.rsplit(":", 1)[1]
    result = subprocess.run(
        tandem_command("serve", "--port", str(port), "--frontends", "2", "--http-port", "0"),
        env=child_env(), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert port in result.stderr


def test_stopping_serve_stops_every_frontend(tiny_llama_dir: str, tmp_path: Path) -> None:
    serve, _, _ = _serve(tiny_llama_dir, 2, tmp_path)
    children = descendants(serve.proc.pid)
    assert len(children) >= 2  # an engine and a frontend
    serve.proc.terminate()
    assert serve.proc.wait(90) == 0, serve.log_tail()
    time.sleep(0.5)
    assert [p for p in children if os.path.exists(f"/proc/{p}") and _cmdline(p)] == []
