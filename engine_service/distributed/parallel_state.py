"""torch.distributed set-up of one engine's tensor-parallel group, and its collectives.

Every rank of an engine builds one ``Communicator``: rank 0 is the engine process,
ranks 1..N-1 its worker processes. Tensors travel over the device group (gloo on CPU,
NCCL on CUDA); the per-step description and control messages are Python objects and
travel over a gloo group (the device group itself when that is gloo already).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine_service.config import ConfigError

logger = logging.getLogger(__name__)

# Backstop on every collective: a peer that neither answers nor closes its connection
# for this long fails the step (a dead peer closes its sockets and fails it at once).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


def resolve_backend(requested: str, device: torch.device) -> str:
    """auto: nccl on CUDA, gloo on CPU. NCCL needs CUDA tensors."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError(f"distributed_backend=nccl needs a CUDA device, got {device}")
    if requested not in ("gloo", "nccl"):
        raise ConfigError(f"distributed_backend must be auto, gloo or nccl, got {requested!r}")
    return requested


def default_init_method() -> str:
    """A rendezvous on a free loopback port (rank 0's TCP store listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def device_for_rank(device: torch.device, rank: int) -> torch.device:
    """CPU: every rank on the CPU. CUDA: rank r on the configured index + r."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def split_cores(world_size: int) -> list[list[int]]:
    """This process's allowed cores cut into ``world_size`` contiguous shares; empty
    shares (no pinning) where there are fewer cores than ranks or no affinity API."""
    if not hasattr(os, "sched_getaffinity"):
        return [[] for _ in range(world_size)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world_size:
        return [[] for _ in range(world_size)]
    share = len(cores) // world_size
    return [cores[r * share : (r + 1) * share] for r in range(world_size)]


def place_threads(cores: list[int], num_threads: int | None, world_size: int) -> int:
    """Pin this process to ``cores`` (if any) and set torch's intra-op threads to
    ``num_threads`` (default: one per core of the share; unpinned, the cores divided by
    ``world_size``). Returns the thread count."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    threads = num_threads or len(cores) or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    return threads


@dataclass(frozen=True)
class ParallelSpec:
    """What a rank needs to join its group (picklable: it crosses to the workers)."""

    world_size: int
    init_method: str
    backend: str  # gloo | nccl


class Communicator:
    """One rank's view of the group: its collectives over ``device_group`` and its
    object messages over ``cpu_group``."""

    def __init__(self, rank: int, spec: ParallelSpec, device: torch.device) -> None:
        self.rank = rank
        self.world_size = spec.world_size
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend=spec.backend,
            init_method=spec.init_method,
            rank=rank,
            world_size=spec.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self.device_group: Any = dist.group.WORLD
        self.cpu_group: Any = (
            dist.group.WORLD if spec.backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        )
        logger.info("tensor-parallel rank %d/%d joined (%s, %s)", rank, spec.world_size, spec.backend, device)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``tensor``."""
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``[..., d]`` on every rank -> ``[..., world_size * d]`` on rank 0 (rank order);
        None on the others."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(tensor.contiguous(), parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj``; every rank returns it (one pickled message)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
