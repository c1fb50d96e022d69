"""An engine's start-up: the model loaded, the KV cache sized and allocated, the
components that serve requests built over them, then the Triton kernels and CUDA graphs
warmed; each phase a span when traced.

``start_up`` returns the components as ``EngineParts``, which ``EngineCore`` stores;
nothing here knows the core. ``ModelLoader`` is the two steps sleep mode redoes on
wake (reload the weights, allocate a KV cache of the size chosen here), handed on as
``EngineParts.load_model`` and ``EngineParts.allocate_kv_caches``. ``ScratchForward``
runs the forwards that size the KV cache on CUDA and warm the Triton kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine_service.admission import AdmissionController, AdmissionLimits
from engine_service.async_scheduler import AsyncScheduler
from engine_service.attention import AttentionMetadata
from engine_service.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError, EngineConfig
from engine_service.distributed.executor import TensorParallelExecutor
from engine_service.distributed.worker import load_shard
from engine_service.engine_step import AsyncStep, Execution, SyncStep
from engine_service.kv_cache.manager import KVCacheManager
from engine_service.kv_cache.memory import (
    allocate_kv_caches,
    kv_cache_block_bytes,
    profile_num_gpu_blocks,
    window_split,
)
from engine_service.kv_cache.sliding import SlidingWindowBlocks
from engine_service.kv_transfer import CacheLayout, KvConnector, NoConnector
from engine_service.lora import LoRAManager
from engine_service.lora.engine_api import preload_loras
from engine_service.model_runner import ModelRunner
from engine_service.models.decoder import DecoderForCausalLM
from engine_service.models.loader import load_model
from engine_service.profiler import Profiler
from engine_service.scheduler import Scheduler
from engine_service.spec_decode.build import build_speculator
from engine_service.spec_decode.draft_model import load_draft_model
from engine_service.step_observer import StepObserver
from engine_service.step_outputs import StepOutputs
from engine_service.structured_output import StructuredOutputManager
from engine_service.thread_governor import ThreadGovernor
from kernels.dispatch import KernelOps, get_ops
from tandem.protocol.model_config import ModelConfig

logger = logging.getLogger(__name__)

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key, value) block tensors


class Span(Protocol):
    """What start-up records on an OpenTelemetry span."""

    def set_attributes(self, attributes: Mapping[str, Any]) -> None: ...


class Tracer(Protocol):
    """What start-up asks of an OpenTelemetry tracer: a span per phase."""

    def start_as_current_span(self, name: str) -> contextlib.AbstractContextManager[Span]: ...


@dataclass(frozen=True)
class EngineParts:
    """What start-up built for one engine. ``runner.model`` is the model (rank 0's shard
    with tensor parallelism)."""

    model_config: ModelConfig  # the whole model's (not a shard's)
    max_model_len: int
    num_blocks: int  # KV-cache blocks of this rank
    lora: LoRAManager | None  # None without --enable-lora
    kv_manager: KVCacheManager
    scheduler: Scheduler
    structured: StructuredOutputManager
    runner: ModelRunner
    admission: AdmissionController
    observer: StepObserver
    step: SyncStep | AsyncStep  # schedule -> execute -> update -> emit, in the configured mode
    outputs: StepOutputs
    profiler: Profiler
    load_model: Callable[[], torch.nn.Module]  # the weights loaded again, as at start-up
    allocate_kv_caches: Callable[[], KvCaches]  # a KV cache of ``num_blocks`` blocks


def start_up(
    config: EngineConfig,
    engine_index: int,
    executor: TensorParallelExecutor | None,
    governor: ThreadGovernor | None,
    kv_connector: KvConnector,
    tracer: Tracer | None,
) -> EngineParts:
    """Load, size, allocate and build, then warm up. ``executor``: the tensor-parallel
    workers (already loading their shards), None with one process; ``governor``: the
    CPU thread governor the step observer feeds, if any; ``kv_connector``: gets the KV
    cache registered; ``tracer``: an OpenTelemetry tracer for the phases' spans, or None.
    On failure what was built here is closed; the caller stops the executor."""
    start = time.perf_counter()
    ops = get_ops(config.resolved_attention_backend, config.triton_gemv, config.triton_split_kv)
    loader = ModelLoader(config, ops, executor)
    with _phase(tracer, "load_model") as span:
        model, model_config = loader.load()
        if span is not None:
            span.set_attributes({
                "tandem.model": config.model,
                "tandem.architecture": model_config.architecture,
                "tandem.dtype": str(config.torch_dtype).removeprefix("torch."),
                "tandem.device": str(config.torch_device),
            })
    # The KV cache's shapes: this rank's kv heads (all of them without TP).
    shard_config: ModelConfig = model.config
    lora: LoRAManager | None = None
    if config.enable_lora:
        lora = LoRAManager(
            model, model_config, config.max_loras, config.max_lora_rank,
            config.resolved_max_cpu_loras, config.torch_dtype, config.torch_device,
        )
        preload_loras(lora, config.lora_modules)
    max_model_len = resolve_max_model_len(config, model_config)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"max_num_batched_tokens={config.max_num_batched_tokens} is below "
            f"max_model_len={max_model_len}; without chunked prefill a long prompt "
            "could never be scheduled"
        )
    scratch = ScratchForward(config, model, shard_config, executor)
    # A draft model (speculative decoding) holds as many KV tokens as the target: its
    # layers take their share of the KV budget.
    draft = None
    if config.speculative is not None and config.speculative.method == "draft_model":
        with _phase(tracer, "load_draft_model"):
            draft = load_draft_model(config, ops, model_config, max_model_len)
    draft_block_bytes = 0 if draft is None else kv_cache_block_bytes(draft[1], config.block_size, config.torch_dtype)
    with _phase(tracer, "allocate_kv_cache") as span:
        num_blocks = num_kv_blocks(config, model, shard_config, max_model_len, executor, scratch, draft_block_bytes)
        window_blocks = None
        # Sliding-window layers keep only their window's blocks (kv_cache/sliding.py), with
        # one process and no KV connector (whose transfers address one block table).
        if shard_config.sliding_window is not None and executor is None and isinstance(kv_connector, NoConnector):
            num_blocks, window_blocks = window_split(
                shard_config, num_blocks, config.block_size, config.max_num_seqs,
                min(config.max_num_batched_tokens, max_model_len), max_model_len,
            )
            logger.info("sliding-window layers: %d blocks of their own, full layers %d", window_blocks, num_blocks)
        kv_caches = loader.allocate_kv_caches(shard_config, num_blocks, window_blocks)
        if span is not None:
            span.set_attributes({
                "tandem.kv_cache.num_blocks": num_blocks,
                "tandem.kv_cache.block_size": config.block_size,
                "tandem.kv_cache.bytes": num_blocks
                * kv_cache_block_bytes(shard_config, config.block_size, config.torch_dtype),
                "tandem.tensor_parallel_size": config.tensor_parallel_size,
            })
    with contextlib.ExitStack() as on_failure:
        window = None
        if window_blocks is not None:
            assert shard_config.sliding_window is not None
            window = SlidingWindowBlocks(
                window_blocks, config.block_size, shard_config.sliding_window, config.enable_prefix_caching
            )
        kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, window)
        structured = StructuredOutputManager(
            config.tokenizer or config.model,
            model_config.vocab_size,
            ops.apply_token_bitmask,
            cache_size=config.structured_output_cache_size,
        )
        on_failure.callback(structured.close)
        speculator = None
        if config.speculative is not None:
            speculator = build_speculator(config, ops, model, model_config, num_blocks, draft)
        # Async scheduling is its own scheduler and step, chosen here once.
        scheduler = (AsyncScheduler if config.async_scheduling else Scheduler)(
            kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            lora=lora,
            kv_connector=kv_connector,
            structured=structured,
            speculator=speculator,
        )
        runner = ModelRunner(
            config, model, model_config, kv_caches, kv_manager, structured, lora,
            executor, max_blocks_per_seq=-(-max_model_len // config.block_size),
        )
        on_failure.callback(runner.release_cuda_graphs)
        mc = shard_config
        kv_connector.register_kv_caches(
            lambda: runner.kv_caches,
            CacheLayout(str(config.torch_dtype).removeprefix("torch."), mc.num_layers, config.block_size,
                        mc.num_kv_heads, mc.head_dim),
        )
        admission = AdmissionController(admission_limits(config, num_blocks))
        observer = StepObserver(scheduler, admission.drain_rate, governor)
        execution = Execution(runner, observer, (structured.wait_if_idle, kv_connector.wait_if_idle), executor)
        outputs = StepOutputs(scheduler, engine_index)
        step: SyncStep | AsyncStep = (
            AsyncStep(scheduler, execution, outputs)
            if isinstance(scheduler, AsyncScheduler)
            else SyncStep(scheduler, execution, outputs)
        )
        profiler = Profiler(config.profiler_dir, engine_index)
        if config.torch_device.type == "cuda" and config.resolved_attention_backend == "triton":
            warm_up_kernels(config, scratch, max_model_len, engine_index)
        runner.capture_cuda_graphs()
        on_failure.pop_all()  # built: the engine owns them now
    logger.info(
        "engine %d ready in %.1fs: %s, %d KV blocks of %d tokens, max_model_len %d",
        engine_index,
        time.perf_counter() - start,
        model_config.architecture,
        num_blocks,
        config.block_size,
        max_model_len,
    )
    return EngineParts(
        model_config=model_config,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        lora=lora,
        kv_manager=kv_manager,
        scheduler=scheduler,
        structured=structured,
        runner=runner,
        admission=admission,
        observer=observer,
        step=step,
        outputs=outputs,
        profiler=profiler,
        load_model=lambda: loader.load()[0],
        allocate_kv_caches=functools.partial(loader.allocate_kv_caches, shard_config, num_blocks, window_blocks),
    )


class ModelLoader:
    """This rank's weights and KV cache, as the config says. With tensor parallelism
    (``executor``) this process loads rank 0's shard and the workers allocate their KV
    caches alongside."""

    def __init__(self, config: EngineConfig, ops: KernelOps, executor: TensorParallelExecutor | None) -> None:
        self.config = config
        self.ops = ops
        self.executor = executor

    def load(self) -> tuple[DecoderForCausalLM, ModelConfig]:
        """The model (packed in the config's linear layout) and the whole model's config."""
        cfg, ops = self.config, self.ops
        if self.executor is not None:
            shard = load_shard(cfg, self.executor.comm, self.executor.device)
            return shard, shard.plan.config
        cuda = cfg.torch_device.type == "cuda"
        model, model_config = load_model(
            cfg.model, cfg.torch_dtype, cfg.torch_device, ops, keep_int8=cfg.keep_int8_checkpoint_weights,
            keep_fp8=cuda,
            keep_int4=cfg.keep_int4_checkpoint_weights,
        )
        if cuda:  # 4-bit and FP8 checkpoint weights stay quantized (models/gpu_quant.py)
            model.pack_quantized_cuda()
        if cfg.linear_layout != "torch":
            model.pack_linears(cfg.linear_layout, lm_head_screen=cfg.lm_head_screen)
        model.native_decode = (
            cfg.native_decode and ops.name == "cpu" and cfg.linear_layout in ("panel", "panel_int8")
        )
        return model, model_config

    def allocate_kv_caches(
        self, shard_config: ModelConfig, num_blocks: int, window_blocks: int | None = None
    ) -> KvCaches:
        """``num_blocks`` blocks shaped by ``shard_config`` (this rank's kv heads);
        ``window_blocks`` for the sliding-window layers (one process only)."""
        cfg = self.config
        if self.executor is not None:
            self.executor.allocate_kv_cache(num_blocks)
        return allocate_kv_caches(
            shard_config, num_blocks, cfg.block_size, cfg.torch_dtype, cfg.torch_device, window_blocks
        )


class ScratchForward:
    """Forwards of made-up tokens on a throwaway KV cache (shared by every sequence:
    what is written there is never read back), so the engine's own cache and state are
    untouched. With tensor parallelism every rank runs each one alike."""

    def __init__(
        self, config: EngineConfig, model: DecoderForCausalLM, shard_config: ModelConfig,
        executor: TensorParallelExecutor | None,
    ) -> None:
        self.config = config
        self.model = model
        self.shard_config = shard_config
        self.executor = executor

    def __call__(self, num_seqs: int, tokens_per_seq: int, width: int) -> None:
        """``num_seqs`` sequences of ``tokens_per_seq`` new tokens each, the last of a
        context that needs ``width`` KV blocks, on a cache of ``width`` blocks."""
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
            if self.executor is not None:
                self.executor.broadcast_step(ids, positions, attn, logit_rows, width)
            hidden = self.model(ids, positions, caches, attn)
            self.model.compute_logits(hidden[logit_rows])
        del caches

    def peak(self, max_model_len: int) -> None:
        """The largest step: max_num_batched_tokens tokens of one sequence (the memory
        profile's peak)."""
        n = min(self.config.max_num_batched_tokens, max_model_len)
        self(num_seqs=1, tokens_per_seq=n, width=-(-n // self.config.block_size))


def resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    """--max-model-len, which may not exceed the model's limit; default: that limit."""
    limit = mc.max_position_embeddings
    wanted = config.max_model_len
    if wanted is None:
        return limit
    if wanted > limit:
        raise ConfigError(
            f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit} "
            f"({config.model}/config.json)"
        )
    return wanted


def num_kv_blocks(
    config: EngineConfig,
    model: DecoderForCausalLM,
    shard_config: ModelConfig,
    max_model_len: int,
    executor: TensorParallelExecutor | None,
    scratch: ScratchForward,
    extra_block_bytes: int = 0,
) -> int:
    """KV-cache blocks of this rank's budget; ConfigError when one request of
    ``max_model_len`` would not fit. ``extra_block_bytes``: what each block costs beyond
    the model's own (a draft model's blocks, as many as the target's)."""
    cfg = config
    # Per rank: each rank's memory holds its own kv heads of every block; with an
    # uneven split the rank with the most decides.
    sizing = shard_config
    if executor is not None:
        sizing = dataclasses.replace(sizing, num_kv_heads=model.plan.max_num_kv_heads)
    block_bytes = kv_cache_block_bytes(sizing, cfg.block_size, cfg.torch_dtype) + extra_block_bytes
    if cfg.num_gpu_blocks_override is not None:
        num_blocks = cfg.num_gpu_blocks_override
        source = "num_gpu_blocks_override"
    elif cfg.kv_cache_memory_bytes is not None:
        num_blocks = cfg.kv_cache_memory_bytes // block_bytes
        source = f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes}"
    elif cfg.torch_device.type == "cuda":
        num_blocks = profile_num_gpu_blocks(cfg, model, block_bytes, lambda: scratch.peak(max_model_len))
        source = f"gpu_memory_utilization={cfg.gpu_memory_utilization}"
    else:
        num_blocks = DEFAULT_CPU_KV_CACHE_BYTES // block_bytes
        source = f"the default CPU budget of {DEFAULT_CPU_KV_CACHE_BYTES} bytes"
    needed = -(-max_model_len // cfg.block_size)
    if num_blocks < needed:
        raise ConfigError(
            f"the KV cache from {source} holds {num_blocks} blocks "
            f"({num_blocks * cfg.block_size} tokens, {block_bytes} bytes per block), but one "
            f"request of max_model_len={max_model_len} needs {needed} blocks: raise the "
            "KV-cache budget or lower max_model_len"
        )
    return num_blocks


def admission_limits(config: EngineConfig, num_blocks: int) -> AdmissionLimits:
    """The waiting queue's bounds; the token bound is a multiple of the KV cache's capacity."""
    capacity = num_blocks * config.block_size  # tokens the KV cache holds
    return AdmissionLimits(
        max_pending_requests=config.resolved_max_pending_requests,
        max_pending_tokens=int(config.max_pending_kv_multiple * capacity),
    )


def warm_up_kernels(config: EngineConfig, scratch: ScratchForward, max_model_len: int, engine_index: int) -> None:
    """Compile the Triton kernels' variants before the first request. Triton
    specialises a kernel on each integer argument being 1, a multiple of 16 or
    neither (and the attention's tiles on decode vs prefill), so the first step of
    each new class (batch size, prompt chunk, block-table width) would otherwise stop
    mid-decode for a compile. Compiled kernels also land in Triton's on-disk cache, so
    a later start only loads them."""
    start = time.perf_counter()
    shapes = warm_up_shapes(config.max_num_seqs, config.max_num_batched_tokens, max_model_len, config.block_size)
    for num_seqs, tokens_per_seq, width in shapes:
        scratch(num_seqs, tokens_per_seq, width)
    logger.info("engine %d: Triton kernels warmed up in %.1fs", engine_index, time.perf_counter() - start)


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
    """The connector ``config.kv_role`` asks for (over gRPC, no engine token), or none."""
    if config.kv_role is None:
        return NoConnector()
    from engine_service.kv_transfer.grpc_connector import GrpcKvConnector

    return GrpcKvConnector(
        config.kv_role, config.resolved_kv_engine_id(engine_index), config.kv_address or "",
        config.block_size, config.kv_transfer_timeout_s,
    )


def _phase(tracer: Tracer | None, name: str) -> contextlib.AbstractContextManager[Span | None]:
    """A span named ``name`` under the current span, or nothing without a tracer."""
    if tracer is None:
        return contextlib.nullcontext()
    return tracer.start_as_current_span(name)
