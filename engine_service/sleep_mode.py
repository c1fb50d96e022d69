"""Sleep mode of an engine (vLLM's sleep / wake_up / is_sleeping).

``SleepController`` gives the engine's memory back while it is idle and restores it.
It is given the pieces whose memory it moves (the runner's weights, KV cache and CUDA
graphs, the LoRA manager's base-weight references, the tensor-parallel workers) and two
start-up steps to redo on wake: reloading the weights and allocating a KV cache.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine_service.cpu import release_free_memory

if TYPE_CHECKING:
    from engine_service.config import EngineConfig
    from engine_service.distributed.executor import TensorParallelExecutor
    from engine_service.kv_cache.manager import KVCacheManager
    from engine_service.lora import LoRAManager
    from engine_service.model_runner import ModelRunner
    from engine_service.scheduler import Scheduler
    from engine_service.spec_decode.draft_model import DraftModel
    from engine_service.startup import KvCaches

logger = logging.getLogger(__name__)


class EngineBusyError(RuntimeError):
    """An operation that needs an idle engine was asked of a busy one."""


class SleepController:
    """The sleep level of one engine: 0 awake; 1 KV cache released (on CUDA the weights
    in host memory); 2 the weights released too. Runs on the engine thread."""

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int,
        runner: ModelRunner,
        kv_manager: KVCacheManager,
        scheduler: Scheduler,
        lora: LoRAManager | None,
        executor: TensorParallelExecutor | None,
        *,
        load_model: Callable[[], torch.nn.Module],
        allocate_kv_caches: Callable[[], KvCaches],
        busy: Callable[[], bool],
    ) -> None:
        """``load_model``: this rank's weights loaded again (level 2's wake-up);
        ``allocate_kv_caches``: a KV cache of the size start-up chose; ``busy``: whether
        the engine has unfinished work (sleeping then is refused). ``executor``: the
        tensor-parallel workers, which sleep and wake alike; None: one process."""
        self.config = config
        self.engine_index = engine_index
        self.runner = runner
        self.kv_manager = kv_manager
        self.scheduler = scheduler
        self.lora = lora
        self.executor = executor
        self._load_model = load_model
        self._allocate_kv_caches = allocate_kv_caches
        self._busy = busy
        self.level = 0

    def sleep(self, level: int = 1) -> None:
        """Give back memory while idle. Level 1: the KV cache (and, on CUDA, the weights
        move to host memory); level 2: the weights too (reloaded from the checkpoint on
        wake). The prefix cache is dropped. Raises EngineBusyError while requests are
        unfinished."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self._busy():
            raise EngineBusyError(
                f"cannot sleep with {self.scheduler.num_unfinished} unfinished requests: "
                "let them finish (pause the frontend first) or abort them"
            )
        if level <= self.level:
            return
        self.scheduler.drop_kv_transfers()  # KV held for other engines goes with the cache
        self.kv_manager.reset_prefix_cache()
        if self.executor is not None:
            self.executor.sleep(level)
        self.runner.release_cuda_graphs()  # they hold the weights' and the cache's addresses
        self.runner.kv_caches = []
        draft = self._draft_model()
        if draft is not None:
            draft.sleep(level)
        if level == 2:
            self.runner.model = None  # type: ignore[assignment]  # the runner's only reference
            if self.lora is not None:  # adapters stay loaded; only the base weights go
                self.lora.release_base()
        elif self.config.torch_device.type == "cuda":
            self.runner.model.to("cpu")
        self.level = level
        gc.collect()
        if self.config.torch_device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_free_memory()
        logger.info("engine %d asleep at level %d", self.engine_index, level)

    def wake_up(self) -> None:
        """Undo ``sleep``: weights back (reloaded at level 2), a fresh KV cache."""
        if not self.level:
            return
        if self.executor is not None:
            self.executor.wake_up()
        if self.level == 2:
            model = self._load_model()
            if self.lora is not None:
                self.lora.rebind(model)
            self.runner.model = model
        elif self.config.torch_device.type == "cuda":
            self.runner.model.to(self.config.torch_device)
        self.runner.kv_caches = self._allocate_kv_caches()
        draft = self._draft_model()
        if draft is not None:
            draft.wake_up()
        self.runner.capture_cuda_graphs()
        self.level = 0
        logger.info("engine %d awake", self.engine_index)

    def _draft_model(self) -> DraftModel | None:
        """Speculative decoding's draft model, whose memory sleeps with the engine's."""
        speculator = self.scheduler.speculator
        return None if speculator is None else speculator.draft_model

    def is_sleeping(self) -> bool:
        return self.level > 0

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache tensors hold now (0 while asleep)."""
        return sum(k.nbytes + v.nbytes for k, v in self.runner.kv_caches)
