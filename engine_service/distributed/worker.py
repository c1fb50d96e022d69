"""A tensor-parallel worker process (ranks 1..N-1 of an engine).

It loads its shard of the weights, holds its shard of the KV cache (its kv heads, all
blocks) and then follows rank 0: each broadcast message is one forward pass or one
control action. It keeps no scheduler state: block ids come with every step. It exits
when rank 0 says so, when a collective fails, or when the engine process dies (the
parent pipe reaches EOF), so a worker never outlives its engine.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from engine_service.config import EngineConfig
from engine_service.cpu import keep_freed_memory_mapped
from engine_service.distributed.layers import ShardedDecoderForCausalLM, load_sharded_model
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
    device_for_rank,
    place_threads,
)
from engine_service.kv_cache.memory import allocate_kv_caches
from kernels.dispatch import get_ops

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker is started with (pickled across the spawn)."""

    config: EngineConfig
    rank: int
    parallel: ParallelSpec
    cores: list[int]  # CPU cores to pin to; empty: no pinning


def load_shard(config: EngineConfig, comm: Communicator, device: torch.device) -> ShardedDecoderForCausalLM:
    """This rank's shard, packed as the engine's linear layout says (rank 0 and the
    workers load the same way)."""
    model, _ = load_sharded_model(
        config.model, config.torch_dtype, device, get_ops(config.resolved_attention_backend, config.triton_gemv, config.triton_split_kv), comm
    )
    if config.linear_layout != "torch":
        model.pack_linears(config.linear_layout)
    return model


class ShardWorker:
    """The state of one worker rank and what each message does to it."""

    def __init__(self, spec: WorkerSpec, comm: Communicator, device: torch.device) -> None:
        self.config = spec.config
        self.comm = comm
        self.device = device
        self.model: ShardedDecoderForCausalLM | None = load_shard(spec.config, comm, device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def handle(self, message: Message) -> bool:
        """Apply one message; False when the worker should exit."""
        if isinstance(message, StepDescription):
            self.step(message)
        elif isinstance(message, AllocateKVCache):
            self.kv_caches = []
            if message.num_blocks:
                self.kv_caches = self._allocate(message.num_blocks)
        elif isinstance(message, Sleep):
            self.kv_caches = []
            if message.level == 2:
                self.model = None
            elif self.device.type == "cuda" and self.model is not None:
                self.model.to("cpu")
            gc.collect()
        elif isinstance(message, WakeUp):
            if self.model is None:
                self.model = load_shard(self.config, self.comm, self.device)
            else:
                self.model.to(self.device)
        elif isinstance(message, Shutdown):
            return False
        else:
            raise TypeError(f"unknown tensor-parallel message {type(message).__name__}")
        return True

    def _allocate(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.model is None:
            raise RuntimeError("KV cache asked for while the weights are released (asleep)")
        cfg = self.config
        return allocate_kv_caches(self.model.config, num_blocks, cfg.block_size, cfg.torch_dtype, self.device)

    @torch.inference_mode()
    def step(self, desc: StepDescription) -> None:
        """The same forward as rank 0's, then this rank's part of the logits gather."""
        if self.model is None:
            raise RuntimeError("a step arrived while the weights are released (asleep)")
        input_ids, positions, attn, logit_rows = desc.to_tensors(self.device)
        caches = self._allocate(desc.scratch_blocks) if desc.scratch_blocks else self.kv_caches
        hidden = self.model(input_ids, positions, caches, attn)
        if logit_rows.numel():
            self.model.compute_logits(hidden[logit_rows])


def _exit_with_parent(parent: Connection) -> None:
    """Exit at once when the engine process is gone: its end of the pipe closes then."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            parent.recv()
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def worker_main(spec: WorkerSpec, parent: Connection) -> None:
    """Entry point of a spawned worker process."""
    _exit_with_parent(parent)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{spec.rank} %(name)s: %(message)s"
    )
    config = spec.config
    if config.torch_device.type == "cpu":
        keep_freed_memory_mapped()
    threads = place_threads(spec.cores, config.num_threads, spec.parallel.world_size)
    torch.manual_seed(config.seed)
    device = device_for_rank(config.torch_device, spec.rank)
    comm = Communicator(spec.rank, spec.parallel, device)
    try:
        worker = ShardWorker(spec, comm, device)
        logger.info("worker pid %d ready: %d threads, cores %s", os.getpid(), threads, spec.cores or "all")
        while worker.handle(comm.broadcast_object()):
            pass
    finally:
        comm.close()
