"""An EngineCore's start-up, mixed into it: model, KV cache sized and allocated,
scheduler, runner and their hooks, then the Triton kernels and CUDA graphs warmed, each
phase a span when traced. ``EngineCore.__init__`` runs ``_start_up`` once the thread
team and the tensor-parallel workers are set; sleep mode reuses ``_load_model`` and
``_allocate_kv_caches``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch

from engine_service.admission import AdmissionController, AdmissionLimits
from engine_service.attention import AttentionMetadata
from engine_service.config import ConfigError, EngineConfig
from engine_service.distributed.worker import load_shard
from engine_service.kv_cache.manager import KVCacheManager
from engine_service.kv_cache.memory import (
    allocate_kv_caches,
    kv_cache_block_bytes,
    profile_num_gpu_blocks,
)
from engine_service.kv_transfer import CacheLayout, KvConnector, NoConnector
from engine_service.lora import LoRAManager
from engine_service.model_runner import ModelRunner
from engine_service.models.loader import load_model
from engine_service.profiler import Profiler
from engine_service.scheduler import Scheduler
from engine_service.step_observer import StepObserver
from engine_service.step_pipeline import StepPipeline
from engine_service.structured_output import StructuredOutputManager
from kernels.dispatch import get_ops
from tandem.protocol.model_config import ModelConfig

logger = logging.getLogger(__name__)


class EngineStartUp:
    """Needs the core's config, engine_index, executor, governor and kv_connector (set by
    ``EngineCore.__init__`` first) and its ``_preload_loras`` (LoRA utilities); sets the
    rest of the core's state."""

    config: EngineConfig
    engine_index: int
    executor: Any  # TensorParallelExecutor | None
    governor: Any  # ThreadGovernor | None
    kv_connector: KvConnector

    def _start_up(self, tracer: Any) -> None:
        """Model, KV cache, scheduler and runner (``__init__``'s second half)."""
        config = self.config
        engine_index = self.engine_index
        start = time.perf_counter()
        ops = get_ops(config.resolved_attention_backend, config.triton_gemv, config.triton_split_kv)
        self._ops = ops
        with _phase(tracer, "load_model") as span:
            self.model, self.model_config = self._load_model()
            if span is not None:
                span.set_attributes({
                    "tandem.model": config.model,
                    "tandem.architecture": self.model_config.architecture,
                    "tandem.dtype": str(config.torch_dtype).removeprefix("torch."),
                    "tandem.device": str(config.torch_device),
                })
        # The KV cache's shapes: this rank's kv heads (all of them without TP).
        self.shard_config: ModelConfig = self.model.config
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(
                self.model, self.model_config, config.max_loras, config.max_lora_rank,
                config.resolved_max_cpu_loras, config.torch_dtype, config.torch_device,
            )
            self._preload_loras(config.lora_modules)
        self.max_model_len = self._resolve_max_model_len(self.model_config)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} is below "
                f"max_model_len={self.max_model_len}; without chunked prefill a long prompt "
                "could never be scheduled"
            )
        with _phase(tracer, "allocate_kv_cache") as span:
            self.num_blocks = self._num_kv_blocks()
            kv_caches = self._allocate_kv_caches()
            if span is not None:
                span.set_attributes({
                    "tandem.kv_cache.num_blocks": self.num_blocks,
                    "tandem.kv_cache.block_size": config.block_size,
                    "tandem.kv_cache.bytes": self.num_blocks
                    * kv_cache_block_bytes(self.shard_config, config.block_size, config.torch_dtype),
                    "tandem.tensor_parallel_size": config.tensor_parallel_size,
                })
        self.kv_manager = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            lora=self.lora,
            kv_connector=self.kv_connector,
        )
        self.structured = StructuredOutputManager(
            config.tokenizer or config.model,
            self.model_config.vocab_size,
            ops.apply_token_bitmask,
            cache_size=config.structured_output_cache_size,
        )
        self.runner = ModelRunner(
            config, self.model, self.model_config, kv_caches, self.kv_manager, self.structured, self.lora,
            self.executor, max_blocks_per_seq=-(-self.max_model_len // config.block_size),
        )
        mc = self.shard_config
        self.kv_connector.register_kv_caches(
            lambda: self.runner.kv_caches,
            CacheLayout(str(config.torch_dtype).removeprefix("torch."), mc.num_layers, config.block_size,
                        mc.num_kv_heads, mc.head_dim),
        )
        self.scheduler.pre_schedule_hooks.append(self.structured.end_failed)
        self.admission = AdmissionController(self._admission_limits())
        self.observer = StepObserver(self.scheduler, self.admission.drain_rate, self.governor)
        self.pipeline = StepPipeline(self) if config.async_scheduling else None
        self.sleep_level = 0  # 0: awake; 1: KV cache released; 2: weights released too
        self.profiler = Profiler(config.profiler_dir, engine_index)
        if config.torch_device.type == "cuda" and config.resolved_attention_backend == "triton":
            self._warm_up_kernels()
        self.runner.capture_cuda_graphs()
        logger.info(
            "engine %d ready in %.1fs: %s, %d KV blocks of %d tokens, max_model_len %d",
            engine_index,
            time.perf_counter() - start,
            self.model_config.architecture,
            self.num_blocks,
            config.block_size,
            self.max_model_len,
        )

    def _load_model(self) -> tuple[torch.nn.Module, ModelConfig]:
        cfg = self.config
        if self.executor is not None:
            model = load_shard(cfg, self.executor.comm, self.executor.device)
            return model, model.plan.config
        model, model_config = load_model(
            cfg.model, cfg.torch_dtype, cfg.torch_device, self._ops, keep_int8=cfg.keep_int8_checkpoint_weights
        )
        if cfg.linear_layout != "torch":
            model.pack_linears(cfg.linear_layout, lm_head_screen=cfg.lm_head_screen)
        model.native_decode = (
            cfg.native_decode and self._ops.name == "cpu" and cfg.linear_layout in ("panel", "panel_int8")
        )
        return model, model_config

    def _allocate_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.config
        if self.executor is not None:
            self.executor.allocate_kv_cache(self.num_blocks)
        return allocate_kv_caches(
            self.shard_config, self.num_blocks, cfg.block_size, cfg.torch_dtype, cfg.torch_device
        )

    def _resolve_max_model_len(self, mc: ModelConfig) -> int:
        limit = mc.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ConfigError(
                f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit} "
                f"({self.config.model}/config.json)"
            )
        return wanted

    def _admission_limits(self) -> AdmissionLimits:
        capacity = self.num_blocks * self.config.block_size  # tokens the KV cache holds
        return AdmissionLimits(
            max_pending_requests=self.config.resolved_max_pending_requests,
            max_pending_tokens=int(self.config.max_pending_kv_multiple * capacity),
        )

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        # Per rank: each rank's memory holds its own kv heads of every block; with an
        # uneven split the rank with the most decides.
        sizing = self.shard_config
        if self.executor is not None:
            sizing = dataclasses.replace(sizing, num_kv_heads=self.model.plan.max_num_kv_heads)
        block_bytes = kv_cache_block_bytes(sizing, cfg.block_size, cfg.torch_dtype)
        if cfg.num_gpu_blocks_override is not None:
            num_blocks = cfg.num_gpu_blocks_override
            source = "num_gpu_blocks_override"
        elif cfg.kv_cache_memory_bytes is not None:
            num_blocks = cfg.kv_cache_memory_bytes // block_bytes
            source = f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes}"
        elif cfg.torch_device.type == "cuda":
            num_blocks = profile_num_gpu_blocks(cfg, self.model, block_bytes, self._dummy_forward)
            source = f"gpu_memory_utilization={cfg.gpu_memory_utilization}"
        else:
            from engine_service.config import DEFAULT_CPU_KV_CACHE_BYTES

            num_blocks = DEFAULT_CPU_KV_CACHE_BYTES // block_bytes
            source = f"the default CPU budget of {DEFAULT_CPU_KV_CACHE_BYTES} bytes"
        needed = -(-self.max_model_len // cfg.block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"the KV cache from {source} holds {num_blocks} blocks "
                f"({num_blocks * cfg.block_size} tokens, {block_bytes} bytes per block), but one "
                f"request of max_model_len={self.max_model_len} needs {needed} blocks: raise the "
                "KV-cache budget or lower max_model_len"
            )
        return num_blocks

    def _dummy_forward(self) -> None:
        """A forward of max_num_batched_tokens tokens on a throwaway one-block cache."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        self._scratch_forward(num_seqs=1, tokens_per_seq=n, width=-(-n // self.config.block_size))

    def _scratch_forward(self, num_seqs: int, tokens_per_seq: int, width: int) -> None:
        """A forward of ``num_seqs`` sequences of ``tokens_per_seq`` new tokens each, the
        last of a context that needs ``width`` KV blocks, on a throwaway cache of ``width``
        blocks (shared by every sequence: what is written there is never read back)."""
        bs, mc, dev = self.config.block_size, self.shard_config, self.config.torch_device
        caches = allocate_kv_caches(mc, width, bs, self.config.torch_dtype, dev)
        seq_len = max(tokens_per_seq, (width - 1) * bs + 1)
        n = num_seqs * tokens_per_seq
        positions = torch.arange(seq_len - tokens_per_seq, seq_len, device=dev).repeat(num_seqs)  # [n]
        attn = AttentionMetadata(
            slot_mapping=positions % (width * bs),
            block_tables=torch.arange(width, dtype=torch.int32, device=dev).repeat(num_seqs, 1),
            query_start_loc=torch.arange(0, n + 1, tokens_per_seq, dtype=torch.int32, device=dev),
            seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=dev),
            max_query_len=tokens_per_seq,
            max_seq_len=seq_len,
        )
        logit_rows = list(range(tokens_per_seq - 1, n, tokens_per_seq))
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.int64, device=dev)
            if self.executor is not None:  # every rank runs it, on a scratch cache alike
                self.executor.broadcast_step(ids, positions, attn, logit_rows, width)
            hidden = self.model(ids, positions, caches, attn)
            self.model.compute_logits(hidden[logit_rows])
        del caches

    def _warm_up_kernels(self) -> None:
        """Compile the Triton kernels' variants before the first request. Triton
        specialises a kernel on each integer argument being 1, a multiple of 16 or
        neither (and the attention's tiles on decode vs prefill), so the first step of
        each new class (batch size, prompt chunk, block-table width) would stop for a
        compile: ~350 ms each on an H200, seen mid-decode. Compiled kernels also land in
        Triton's on-disk cache, so a later start only loads them."""
        start = time.perf_counter()
        cfg = self.config
        shapes = warm_up_shapes(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len, cfg.block_size)
        for num_seqs, tokens_per_seq, width in shapes:
            self._scratch_forward(num_seqs, tokens_per_seq, width)
        logger.info("engine %d: Triton kernels warmed up in %.1fs", self.engine_index, time.perf_counter() - start)


def warm_up_shapes(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int
) -> list[tuple[int, int, int]]:
    """(sequences, new tokens per sequence, block-table width) of the warm-up forwards:
    each count at 1, 2 and 16 (Triton's integer classes: 1, a multiple of 16, neither),
    within the engine's limits: at most ``max_num_seqs`` sequences and
    ``max_num_batched_tokens`` tokens, contexts of at most ``max_model_len``. One new
    token per sequence is decode; more is a prefill chunk."""
    counts = (1, 2, 16)
    return [
        (seqs, tokens, width)
        for seqs in counts
        for tokens in counts
        for width in counts
        if seqs <= max_num_seqs
        and seqs * tokens <= max_num_batched_tokens
        and max(tokens, (width - 1) * block_size + 1) <= max_model_len
    ]


def default_connector(config: EngineConfig, engine_index: int) -> KvConnector:
    if config.kv_role is None:
        return NoConnector()
    from engine_service.kv_transfer.grpc_connector import GrpcKvConnector

    return GrpcKvConnector(
        config.kv_role, config.resolved_kv_engine_id(engine_index), config.kv_address or "",
        config.block_size, config.kv_transfer_timeout_s,
    )


def _phase(tracer: Any, name: str) -> contextlib.AbstractContextManager[Any]:
    """A span named ``name`` under the current span, or nothing without a tracer."""
    if tracer is None:
        return contextlib.nullcontext()
    return tracer.start_as_current_span(name)
