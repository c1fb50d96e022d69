"""The engine API beyond generation (vLLM's names): sleep / wake_up / is_sleeping,
start_profile / stop_profile, reset_prefix_cache, collective_rpc, get_supported_tasks,
check_health, wait_for_requests_to_drain — on EngineCore, the in-process LLM, and over
gRPC through the frontend's admin service."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine_service.admission import RequestRejected
from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.sleep_mode import EngineBusyError
from frontend_service import LLM, SamplingParams
from tandem.protocol.outputs import EngineCoreRequest, ErrorCode
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import ADMIN_METADATA, ENGINE_ARGS, Stack, start_stack

pytest_plugins = ["tests.e2e_helpers"]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(core: EngineCore, rid: str, prompt: list[int]) -> list[int]:
    core.add_request(EngineCoreRequest(rid, prompt, GREEDY))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_wake_gives_the_same_outputs(tiny_llama_dir: str, level: int) -> None:
    core = EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=64))
    before = _run(core, "a", [5, 6, 7, 8])
    kv_bytes = core.kv_cache_bytes
    assert kv_bytes > 0
    core.sleep(level)
    assert core.is_sleeping() and core.kv_cache_bytes == 0
    assert (core.model is None) == (level == 2)
    with pytest.raises(RequestRejected) as refused:
        core.add_request(EngineCoreRequest("asleep", [5, 6], GREEDY))
    assert refused.value.error.code == ErrorCode.UNAVAILABLE
    core.wake_up()
    assert not core.is_sleeping() and core.kv_cache_bytes == kv_bytes
    assert _run(core, "b", [5, 6, 7, 8]) == before
    core.kv_manager.pool.check_all_free()


def test_sleep_refuses_a_busy_engine_and_bad_levels(tiny_llama_dir: str) -> None:
    core = EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=64))
    core.add_request(EngineCoreRequest("busy", [5, 6, 7], GREEDY))
    with pytest.raises(EngineBusyError, match="1 unfinished"):
        core.sleep(1)
    for level in (0, 3, True):
        with pytest.raises(ValueError, match="level"):
            core.sleep(level)  # type: ignore[arg-type]
    assert not core.is_sleeping()


def test_llm_methods(tiny_llama_dir: str, tmp_path: Path) -> None:
    llm = LLM(tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=64, profiler_dir=str(tmp_path))
    before = llm.generate("hello there", GREEDY)[0].outputs[0].token_ids
    llm.sleep(level=1)
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping()
    assert llm.generate("hello there", GREEDY)[0].outputs[0].token_ids == before
    assert llm.get_supported_tasks() == ("generate", "embed")
    assert llm.collective_rpc("num_unfinished_requests") == [0]
    with pytest.raises(ValueError, match="not allowed"):
        llm.collective_rpc("sleep")
    llm.start_profile()
    llm.generate("profile me", GREEDY)
    path = llm.stop_profile()
    assert Path(path).parent == tmp_path
    trace = json.loads(Path(path).read_text())
    assert trace["traceEvents"], "an empty trace"
    assert llm.reset_prefix_cache() >= 0


def test_profiling_off_without_a_directory(tiny_llama_dir: str) -> None:
    llm = LLM(tiny_llama_dir, max_model_len=128, num_gpu_blocks_override=16)
    with pytest.raises(RuntimeError, match="--profiler-dir"):
        llm.start_profile()


# ---- over gRPC ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    profiles = tmp_path_factory.mktemp("profiles")
    with start_stack(
        tiny_llama_dir, 1, tmp_path_factory.mktemp("utility_stack"),
        engine_args=(*ENGINE_ARGS, "--profiler-dir", str(profiles)),
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def admin(stack: Stack) -> Iterator[frontend_pb2_grpc.FrontendAdminStub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield frontend_pb2_grpc.FrontendAdminStub(channel)


def _generate(stack: Stack, prompt: str = "The quick brown fox") -> list[int]:
    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                   output_kind=common_pb2.OUTPUT_KIND_DELTA)
    responses = stack.generation_stub().Generate(
        frontend_pb2.GenerateRequest(prompt=prompt, sampling_params=sp), timeout=60
    )
    return [t for r in responses for o in r.outputs for t in o.token_ids]


def test_sleep_wake_over_grpc(stack: Stack, admin: frontend_pb2_grpc.FrontendAdminStub) -> None:
    before = _generate(stack)
    admin.Sleep(frontend_pb2.SleepRequest(level=2), timeout=60, metadata=ADMIN_METADATA)
    assert admin.IsSleeping(frontend_pb2.IsSleepingRequest(), timeout=10, metadata=ADMIN_METADATA).is_sleeping
    kv = json.loads(admin.CollectiveRpc(
        frontend_pb2.CollectiveRpcRequest(method="kv_cache_bytes"), timeout=10, metadata=ADMIN_METADATA
    ).results[0])
    assert kv == 0
    # A request sent while asleep waits (generation is paused) and runs after WakeUp.
    result: dict[str, list[int]] = {}
    waiter = threading.Thread(target=lambda: result.update(tokens=_generate(stack)))
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive(), "the request did not wait for WakeUp"
    admin.WakeUp(frontend_pb2.WakeUpRequest(), timeout=60, metadata=ADMIN_METADATA)
    waiter.join(60)
    assert result["tokens"] == before
    assert not admin.IsSleeping(frontend_pb2.IsSleepingRequest(), timeout=10, metadata=ADMIN_METADATA).is_sleeping
    assert _generate(stack) == before


def test_admin_utilities_over_grpc(stack: Stack, admin: frontend_pb2_grpc.FrontendAdminStub) -> None:
    admin.CheckHealth(frontend_pb2.CheckHealthRequest(), timeout=10, metadata=ADMIN_METADATA)
    admin.ResetPrefixCache(frontend_pb2.FrontendAdminResetPrefixCacheRequest(), timeout=10, metadata=ADMIN_METADATA)
    tasks = admin.CollectiveRpc(
        frontend_pb2.CollectiveRpcRequest(method="get_supported_tasks"), timeout=10, metadata=ADMIN_METADATA
    )
    assert [json.loads(r) for r in tasks.results] == [["generate", "embed"]]
    admin.StartProfile(frontend_pb2.StartProfileRequest(), timeout=10, metadata=ADMIN_METADATA)
    _generate(stack, "profiled")
    paths = admin.StopProfile(frontend_pb2.StopProfileRequest(), timeout=60, metadata=ADMIN_METADATA).trace_paths
    assert len(paths) == 1 and os.path.getsize(paths[0]) > 0
    with pytest.raises(grpc.RpcError) as bad:
        admin.Sleep(frontend_pb2.SleepRequest(level=3), timeout=10, metadata=ADMIN_METADATA)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as bad:
        admin.CollectiveRpc(frontend_pb2.CollectiveRpcRequest(method="sleep"), timeout=10, metadata=ADMIN_METADATA)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as denied:
        admin.Sleep(frontend_pb2.SleepRequest(level=1), timeout=10)  # no admin token
    assert denied.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def test_sleep_benchmark_runs(tiny_llama_dir: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.sleep_mode", "--model", tiny_llama_dir, "--kv-cache-mib", "16"],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("yes") == 2 and "NO" not in proc.stdout
