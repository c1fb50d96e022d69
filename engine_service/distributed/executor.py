"""Rank 0's side of tensor parallelism: the engine process starts, feeds and
supervises its workers.

Process layout of an engine with ``tensor_parallel_size`` N: the engine process
(gRPC, scheduler, KV block accounting, sampling) is rank 0 and runs its own shard;
N-1 worker processes (multiprocessing spawn) run the other shards. Each step rank 0
broadcasts one ``StepDescription``, all ranks run the forward (two all-reduces per
layer), and the LM head's logits are gathered on rank 0, which samples.

Supervision: a monitor thread waits on the workers' process sentinels. When one dies,
it kills the others; rank 0's pending collective then fails at once (its peers' sockets
closed) and ``WorkerDiedError`` reaches the step, so the engine reports engine-dead
instead of hanging. Workers exit by themselves when the engine process dies.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from engine_service.config import ConfigError, EngineConfig
from engine_service.distributed.messages import (
    AllocateKVCache,
    Message,
    Shutdown,
    Sleep,
    StepDescription,
    WakeUp,
)
from engine_service.distributed.parallel_state import (
    Communicator,
    ParallelSpec,
    default_init_method,
    device_for_rank,
    place_threads,
    resolve_backend,
    split_cores,
)
from engine_service.distributed.sharding import ShardPlan
from engine_service.distributed.worker import WorkerSpec, worker_main
from tandem.protocol.model_config import ModelConfig

logger = logging.getLogger(__name__)

_JOIN_S = 10.0  # a worker's grace to exit after Shutdown before it is killed
_DEATH_NOTICE_S = 5.0  # how long a failed collective waits for the monitor to name the dead worker


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited; the engine cannot run another step."""


class TensorParallelExecutor:
    """Starts ranks 1..N-1, joins the group as rank 0 and broadcasts each step."""

    def __init__(self, config: EngineConfig) -> None:
        world = config.tensor_parallel_size
        device = config.torch_device
        if torch.distributed.is_initialized():
            raise ConfigError(
                "this process already runs a tensor-parallel engine (or another torch.distributed "
                "group); one tensor-parallel engine per process"
            )
        # Refuse a model that does not split before starting any process.
        ShardPlan.build(ModelConfig.from_pretrained(config.model), 0, world)
        spec = ParallelSpec(
            world_size=world,
            init_method=config.distributed_init_method or default_init_method(),
            backend=resolve_backend(config.distributed_backend, device),
        )
        cores = split_cores(world)
        self._saved_affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self._saved_threads = torch.get_num_threads()
        self.dead_reason: str | None = None
        self._closing = False
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._pipes: list[Connection] = []  # write ends: closing them (or dying) stops the workers
        mp = multiprocessing.get_context("spawn")
        for rank in range(1, world):
            receive, send = mp.Pipe(duplex=False)
            proc = mp.Process(
                target=worker_main,
                args=(WorkerSpec(config, rank, spec, cores[rank]), receive),
                name=f"tandem-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            receive.close()
            self._procs.append(proc)
            self._pipes.append(send)
            logger.info("tensor-parallel worker rank %d started: pid %d", rank, proc.pid)
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        self.threads = place_threads(cores[0], config.num_threads, world)
        self.device = device_for_rank(device, 0)
        try:
            self.comm = Communicator(0, spec, self.device)
        except Exception as exc:
            self.shutdown(graceful=False)
            raise self.fail(exc) from exc

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    # ---- messages ----------------------------------------------------------------

    def _send(self, message: Message) -> None:
        self.check_alive()
        try:
            self.comm.broadcast_object(message)
        except Exception as exc:
            raise self.fail(exc) from exc

    def broadcast_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, logit_rows: list[int], scratch_blocks: int = 0
    ) -> None:
        """Start the workers on the forward rank 0 is about to run."""
        self._send(StepDescription.from_tensors(input_ids, positions, attn, logit_rows, scratch_blocks))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._send(AllocateKVCache(num_blocks))

    def sleep(self, level: int) -> None:
        self._send(Sleep(level))

    def wake_up(self) -> None:
        """Weights back on the workers; their KV cache follows with ``allocate_kv_cache``."""
        self._send(WakeUp())

    # ---- supervision -------------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise WorkerDiedError(self.dead_reason)

    def fail(self, exc: BaseException) -> WorkerDiedError:
        """The error for a failed collective: the dead worker's exit once the monitor
        saw it, else the collective's own error."""
        deadline = time.monotonic() + _DEATH_NOTICE_S
        while self.dead_reason is None and time.monotonic() < deadline and self._procs:
            time.sleep(0.05)
        reason = self.dead_reason or f"tensor-parallel collective failed: {type(exc).__name__}: {exc}"
        self._kill_workers()
        self.dead_reason = reason
        return WorkerDiedError(reason)

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self._procs}
        if not sentinels:
            return
        ready = wait(list(sentinels))
        proc = sentinels[ready[0]]  # type: ignore[index]
        proc.join(1.0)
        if self._closing:
            return
        self.dead_reason = (
            f"tensor-parallel worker {proc.name} (pid {proc.pid}) died with exit code {proc.exitcode}"
        )
        logger.error("%s; stopping the other workers", self.dead_reason)
        self._kill_workers()

    def _kill_workers(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    proc.kill()
        for proc in self._procs:
            proc.join(_JOIN_S)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (asked first when ``graceful``, killed after ``_JOIN_S``),
        leave the group and give the engine process its cores and threads back.
        ``graceful=False`` where the ranks may be inside different collectives (a
        failed start-up). Idempotent."""
        if self._closing:
            return
        self._closing = True
        if graceful and self.dead_reason is None and hasattr(self, "comm"):
            with contextlib.suppress(Exception):
                self.comm.broadcast_object(Shutdown())
        deadline = time.monotonic() + _JOIN_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_workers()
        # The monitor may be reaping a worker at this moment (its join and ours race for
        # the exit status; the loser's join returns before the Process records it): once
        # it is done, every worker's exit is recorded and none is left among the children.
        if threading.current_thread() is not self._monitor:
            self._monitor.join(_JOIN_S)
        for pipe in self._pipes:
            pipe.close()
        if hasattr(self, "comm"):
            with contextlib.suppress(Exception):
                self.comm.close()
        if self._saved_affinity is not None:
            os.sched_setaffinity(0, self._saved_affinity)
        torch.set_num_threads(self._saved_threads)
