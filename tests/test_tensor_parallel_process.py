"""A tensor-parallel engine as real processes: a worker SIGKILLed mid-generation makes
the engine report engine-dead (the frontend answers UNAVAILABLE), the engine exits
non-zero and none of its processes is left behind."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest

from engine_service.config import ConfigError, EngineConfig
from engine_service.core import EngineCore
from tandem.v1 import common_pb2, frontend_pb2
from tests.e2e_helpers import ENGINE_ARGS, live_children, start_engine, start_stack

WAIT_S = 60.0


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(condition, what: str, timeout: float = WAIT_S) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc (Linux)")
def test_worker_sigkill_makes_the_engine_dead_and_leaves_no_process(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    args = (*ENGINE_ARGS, "--tensor-parallel-size", "2")
    with start_stack(tiny_llama_dir, 1, tmp_path, engine_args=args) as stack:
        engine = stack.engines[0]
        match = re.search(r"worker rank 1 started: pid (\d+)", engine.log())
        assert match is not None, engine.log_tail()
        worker = int(match.group(1))
        family = live_children(engine.proc.pid)  # the worker and multiprocessing's helpers
        assert worker in family

        stub = stack.generation_stub()
        request = frontend_pb2.GenerateRequest(
            prompt="Once upon a time",
            sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True),
        )
        call = stub.Generate(request, timeout=120)
        first = next(call)
        assert first.outputs  # tokens flow through both ranks
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value

        _wait_for(lambda: not engine.alive, "the engine to exit")
        assert engine.proc.returncode == 1, engine.log_tail()
        log = engine.log()
        assert "tensor-parallel worker tandem-tp-rank1" in log and "died" in log, engine.log_tail()
        _wait_for(lambda: not any(_alive(p) for p in family), f"the engine's children {family} to exit")

        with pytest.raises(grpc.RpcError) as again:
            list(stack.generation_stub().Generate(request, timeout=30))
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc (Linux)")
def test_idle_worker_death_is_noticed_and_a_drained_engine_leaves_no_process(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    args = (*ENGINE_ARGS, "--tensor-parallel-size", "2")
    killed = start_engine(tiny_llama_dir, 0, tmp_path, args)
    drained = start_engine(tiny_llama_dir, 1, tmp_path, args)
    try:
        for engine in (killed, drained):
            engine.wait_serving()
        families = {e.name: live_children(e.proc.pid) for e in (killed, drained)}
        match = re.search(r"worker rank 1 started: pid (\d+)", killed.log())
        assert match is not None, killed.log_tail()
        os.kill(int(match.group(1)), signal.SIGKILL)  # no request running: the idle loop's health poll sees it
        drained.stop()  # SIGTERM: drain, then exit 0
        _wait_for(lambda: not killed.alive, "the idle engine to exit")
        assert killed.proc.returncode == 1, killed.log_tail()
        assert drained.proc.returncode == 0, drained.log_tail()
        for name, family in families.items():
            assert family, name
            _wait_for(lambda f=family: not any(_alive(p) for p in f), f"{name}'s children {family} to exit")
    finally:
        for engine in (killed, drained):
            engine.kill()


def test_a_failed_start_up_leaves_no_worker(tiny_llama_dir: str) -> None:
    """(Here, not in test_tensor_parallel.py: a process runs one tensor-parallel engine
    at a time, and that module keeps one running.)"""
    before = set(multiprocessing.active_children())
    with pytest.raises(ConfigError, match="max_model_len=4096 exceeds"):
        EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=4096, tensor_parallel_size=2, num_threads=1))
    assert set(multiprocessing.active_children()) <= before
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not fit"):
        EngineCore(EngineConfig(model=tiny_llama_dir, tensor_parallel_size=3))
