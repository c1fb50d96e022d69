"""Sleep mode of an EngineCore (vLLM's sleep / wake_up / is_sleeping), mixed into it."""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from engine_service.cpu import release_free_memory

logger = logging.getLogger(__name__)


class EngineBusyError(RuntimeError):
    """An operation that needs an idle engine was asked of a busy one."""


class SleepMode:
    """Needs the core's config, model, runner, kv_manager, lora, scheduler, sleep_level,
    engine_index, ``_load_model`` and ``_allocate_kv_caches``."""

    config: Any
    model: Any
    runner: Any
    kv_manager: Any
    lora: Any
    scheduler: Any
    sleep_level: int
    engine_index: int
    executor: Any  # TensorParallelExecutor | None: the workers sleep and wake alike

    def sleep(self, level: int = 1) -> None:
        """Give back memory while idle. Level 1: the KV cache (and, on CUDA, the weights
        move to host memory); level 2: the weights too (reloaded from the checkpoint on
        wake). The prefix cache is dropped. Requests that arrive while asleep are refused
        with UNAVAILABLE. Raises EngineBusyError while requests are unfinished."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.has_unfinished_requests():  # type: ignore[attr-defined]
            raise EngineBusyError(
                f"cannot sleep with {self.scheduler.num_unfinished} unfinished requests: "
                "let them finish (pause the frontend first) or abort them"
            )
        if level <= self.sleep_level:
            return
        self.scheduler.drop_kv_transfers()  # KV held for other engines goes with the cache
        self.kv_manager.reset_prefix_cache()
        if self.executor is not None:
            self.executor.sleep(level)
        self.runner.release_cuda_graphs()  # they hold the weights' and the cache's addresses
        self.runner.kv_caches = []
        if level == 2:
            self.model = self.runner.model = None  # type: ignore[assignment]
            if self.lora is not None:  # adapters stay loaded; only the base weights go
                self.lora.release_base()
        elif self.config.torch_device.type == "cuda":
            self.model.to("cpu")
        self.sleep_level = level
        gc.collect()
        if self.config.torch_device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_free_memory()
        logger.info("engine %d asleep at level %d", self.engine_index, level)

    def wake_up(self) -> None:
        """Undo ``sleep``: weights back (reloaded at level 2), a fresh KV cache."""
        if not self.sleep_level:
            return
        if self.executor is not None:
            self.executor.wake_up()
        if self.sleep_level == 2:
            self.model, _ = self._load_model()  # type: ignore[attr-defined]
            if self.lora is not None:
                self.lora.rebind(self.model)
            self.runner.model = self.model
        elif self.config.torch_device.type == "cuda":
            self.model.to(self.config.torch_device)
        self.runner.kv_caches = self._allocate_kv_caches()  # type: ignore[attr-defined]
        self.runner.capture_cuda_graphs()
        self.sleep_level = 0
        logger.info("engine %d awake", self.engine_index)

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache tensors hold now (0 while asleep)."""
        return sum(k.nbytes + v.nbytes for k, v in self.runner.kv_caches)
