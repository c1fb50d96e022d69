"""EngineCore: the step loop of one engine, schedule -> execute -> update -> outputs."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch

from engine_service.admission import (
    AdmissionController,
    AdmissionLimits,
    RequestRejected,
    deadline_exceeded,
)
from engine_service.attention import AttentionMetadata
from engine_service.config import ConfigError, EngineConfig
from engine_service.cpu import cpu_quota, default_num_threads, keep_freed_memory_mapped
from engine_service.distributed.executor import TensorParallelExecutor, WorkerDiedError
from engine_service.distributed.worker import load_shard
from engine_service.kv_cache.manager import KVCacheManager
from engine_service.kv_transfer import CacheLayout, KvConnector, NoConnector
from engine_service.lora import LoRAManager
from engine_service.lora.engine_api import LoRAUtilities
from engine_service.model_runner import (
    ModelRunner,
    RunnerOutput,
    allocate_kv_caches,
    kv_cache_block_bytes,
    profile_num_gpu_blocks,
)
from engine_service.models.loader import load_model
from engine_service.profiler import Profiler
from engine_service.request import Request
from engine_service.scheduler import Scheduler, SchedulerOutput
from engine_service.sessions import Sessions
from engine_service.sleep_mode import SleepMode
from engine_service.step_observer import StepObserver
from engine_service.step_pipeline import StepPipeline
from engine_service.structured_output import StructuredOutputManager
from engine_service.thread_governor import ThreadGovernor
from engine_service.validation import RequestValidation
from kernels.dispatch import get_ops
from tandem.protocol.model_config import ModelConfig
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    IterationStats,
    RequestError,
    TokenColumns,
)
from tandem.protocol.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)


class EngineCore(SleepMode, Sessions, RequestValidation, LoRAUtilities):
    """One engine: model, KV cache, scheduler. Not thread-safe: one thread drives it.

    ``EngineCoreLoop`` (core_loop.py) puts a thread and queues around it for services.
    """

    supported_tasks: tuple[str, ...] = ("generate", "embed")  # vLLM's get_supported_tasks()

    def __init__(
        self, config: EngineConfig, engine_index: int = 0, tracer: Any = None, kv_connector: KvConnector | None = None
    ) -> None:
        """``tracer``: an OpenTelemetry tracer to record the start-up phases (model load,
        KV-cache sizing and allocation) as spans under the current span; None: no spans.
        ``kv_connector``: moves KV between engines (kv_transfer/); None: the one
        ``config.kv_role`` asks for (over gRPC, no engine token), or none."""
        if not config.model:
            raise ConfigError("EngineConfig.model is required: a checkpoint directory")
        self.config = config
        self.engine_index = engine_index
        self.kv_connector = kv_connector or _default_connector(config, engine_index)
        self.governor: ThreadGovernor | None = None
        if config.torch_device.type == "cpu":
            keep_freed_memory_mapped()
            if config.tensor_parallel_size == 1:
                threads = config.num_threads or default_num_threads()
                torch.set_num_threads(threads)
                # Under a CPU quota the waits the governor reads are mostly the quota's
                # throttling, which a smaller team does not avoid: no governor there.
                if config.adaptive_threads and threads > 1 and cpu_quota() is None:
                    self.governor = ThreadGovernor(threads)
        torch.manual_seed(config.seed)
        # Tensor parallelism: this process is rank 0; the workers start loading their
        # shards now, while this one loads its own (the executor also places threads).
        self.executor: TensorParallelExecutor | None = None
        if config.tensor_parallel_size > 1:
            self.executor = TensorParallelExecutor(config)

        try:
            self._start_up(tracer)
        except BaseException:
            self.shutdown(graceful=False)  # no worker outlives a failed start-up
            raise

    def _start_up(self, tracer: Any) -> None:
        """Model, KV cache, scheduler and runner (``__init__``'s second half)."""
        config = self.config
        engine_index = self.engine_index
        start = time.perf_counter()
        ops = get_ops(config.resolved_attention_backend, config.triton_gemv)
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
            config.model,
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

    # ---- start-up -----------------------------------------------------------------

    def _load_model(self) -> tuple[torch.nn.Module, ModelConfig]:
        cfg = self.config
        if self.executor is not None:
            model = load_shard(cfg, self.executor.comm, self.executor.device)
            return model, model.plan.config
        model, model_config = load_model(cfg.model, cfg.torch_dtype, cfg.torch_device, self._ops)
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

    # ---- requests --------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request, however long the queue (the in-process LLM, benchmarks).
        Raises InvalidRequestError on bad input, RequestRejected when its deadline has
        already passed."""
        self._queue(req, admission=False)

    def admit_request(self, req: EngineCoreRequest) -> None:
        """Queue a request that arrived through the service: as ``add_request``, and
        RequestRejected(RESOURCE_EXHAUSTED) when the waiting queue is full
        (see admission.py)."""
        self._queue(req, admission=True)

    def _queue(self, req: EngineCoreRequest, admission: bool) -> None:
        if self.sleep_level:
            raise RequestRejected(
                RequestError(ErrorCode.UNAVAILABLE, "the engine is asleep (sleep mode): wake it up first")
            )
        if req.resumable and req.request_id in self.scheduler.sessions:
            if admission:  # a session's next turn queues its new tokens like a new request
                self._check_admission(len(req.prompt_token_ids))
            self._resume_session(req)
            return
        self.validate_request(req)
        if req.kv_transfer_params is not None and isinstance(self.kv_connector, NoConnector):
            # As the reference: the request runs, its transfer is dropped.
            logger.warning(
                "request %s has kv_transfer_params but this engine has no KV connector "
                "(--kv-role): ignored", req.request_id,
            )
            req.kv_transfer_params = None
        if req.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", req.request_id, "a request with this id is running")
        if req.lora_request is not None:
            req.lora_request = self._lora_for_request(req.lora_request)
        request = Request.from_engine_core_request(req)
        if request.deadline is not None and request.deadline <= time.monotonic():
            raise RequestRejected(deadline_exceeded("the request's deadline passed before it was queued"))
        if admission:
            self._check_admission(request.num_tokens)
        self.structured.submit(request)  # a constraint starts compiling now
        self.scheduler.add_request(request)

    def _check_admission(self, num_new_tokens: int) -> None:
        """RequestRejected(RESOURCE_EXHAUSTED) when queueing ``num_new_tokens`` more would
        cross the waiting queue's bounds (admission.py)."""
        waiting = self.scheduler.waiting
        self.admission.check(len(waiting), waiting.num_tokens, num_new_tokens)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in any state; their blocks are free on return."""
        self.scheduler.abort(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        """Requests in the engine, or (async scheduling) a step whose outputs are not out yet."""
        return self.scheduler.num_unfinished > 0 or (self.pipeline is not None and self.pipeline.busy)

    def reset_prefix_cache(self) -> int:
        return self.kv_manager.reset_prefix_cache()

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, update request state, and report what happened."""
        if self.pipeline is not None:  # async scheduling: step_pipeline.py
            return self.pipeline.step()
        return self.run_step(self.scheduler.schedule())

    def run_step(self, sched: SchedulerOutput) -> EngineCoreOutputs:
        with self.observer.execute(sched):
            result = self._execute(sched)
        finished = self.scheduler.update_after_step(sched, result.sampled, result.pooled)
        return self.make_outputs(sched, result, finished)

    def empty_outputs(self) -> EngineCoreOutputs:
        """A step's outputs with nothing in them (a step that only launched work)."""
        return EngineCoreOutputs(engine_index=self.engine_index, scheduler_stats=self.scheduler.stats())

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if sched.is_empty:
            self.structured.wait_if_idle()
            self.kv_connector.wait_if_idle()
            return RunnerOutput()
        if self.executor is None:
            return self.runner.execute(sched)
        try:
            return self.runner.execute(sched)
        except WorkerDiedError:
            raise
        except Exception as exc:  # the ranks are out of step now: the engine is done
            raise self.executor.fail(exc) from exc

    def idle_tick(self) -> None:
        """Housekeeping while no request runs (the loop calls it when woken or every
        second): held KV transfers pulled or expired give their blocks back."""
        self.scheduler.update_kv_transfers()

    def check_health(self) -> None:
        """Raise WorkerDiedError when a tensor-parallel worker died (the core is dead)."""
        if self.executor is not None:
            self.executor.check_alive()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel workers, if any (TensorParallelExecutor.shutdown: joined,
        process group destroyed), the structured-output threads, and let go of the CUDA
        graphs, KV cache and weights (huge-page and CUDA memory return once the last
        tensor goes). Idempotent; the core is unusable afterwards. Also the clean-up of a
        failed start-up, so any attribute may be missing."""
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown(graceful)
        if getattr(self, "structured", None) is not None:
            self.structured.close()
        if getattr(self, "kv_connector", None) is not None:
            self.kv_connector.close()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.release_cuda_graphs()
            runner.kv_caches = []
            runner.model = None
        self.model = None
        if torch.cuda.is_available() and self.config.torch_device.type == "cuda":
            torch.cuda.empty_cache()

    def make_outputs(
        self, sched: SchedulerOutput, result: RunnerOutput, finished: list[Request]
    ) -> EngineCoreOutputs:
        # A request that only got its token this step (the common decode case) goes into
        # the columns: three list appends instead of one EngineCoreOutput each.
        outputs = []
        plain_ids: list[str] = []
        plain_tokens: list[int] = []
        plain_cached: list[int] = []
        logprobs, prompt_logprobs = result.logprobs, result.prompt_logprobs
        for entry in sched.scheduled:
            request = entry.request
            rid = request.request_id
            pooled = result.pooled.get(rid)
            if pooled is not None:
                outputs.append(
                    EngineCoreOutput(
                        request_id=rid,
                        new_token_ids=[],
                        pooling_output=pooled,
                        finish_reason=request.finish_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        trace_headers=request.trace_headers,
                    )
                )
                continue
            token = result.sampled.get(rid)
            if token is None:
                continue
            if request.finish_reason is None and rid not in logprobs and rid not in prompt_logprobs:
                plain_ids.append(rid)
                plain_tokens.append(token)
                plain_cached.append(request.num_cached_tokens)
                continue
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=[token],
                    new_logprobs=logprobs.get(rid),
                    new_prompt_logprobs=prompt_logprobs.get(rid),
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    error=request.error,  # why a request the step ended with ERROR failed
                    # Echoed once, on the final output (not on every step).
                    trace_headers=request.trace_headers if request.finish_reason is not None else None,
                    kv_transfer_params=request.kv_transfer_out,
                )
            )
        columns = None
        if plain_ids:
            # num_cached_tokens is -1 until the prefix cache was looked up; sent as 0.
            cached = [max(c, 0) for c in plain_cached] if min(plain_cached) < 0 else plain_cached
            columns = TokenColumns(plain_ids, plain_tokens, None, cached if any(cached) else None)
        ended = self.scheduler.take_ended()
        for request in ended:
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.finish_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    error=request.error,
                )
            )
        done = {r.request_id for r in finished} | {r.request_id for r in ended}
        num_prompt_tokens, num_generation_tokens = self.scheduler.take_token_counts()
        iteration = IterationStats(
            num_prompt_tokens, num_generation_tokens, finished + ended,
            num_scheduled_reqs=len(sched.scheduled), num_scheduled_tokens=sched.num_scheduled_tokens,
        )
        return EngineCoreOutputs(
            engine_index=self.engine_index,
            outputs=outputs,
            scheduler_stats=self.scheduler.stats(),
            finished_requests=done or None,
            token_columns=columns,
            iteration_stats=iteration,
        )

    def take_abort_outputs(self) -> EngineCoreOutputs | None:
        """Outputs for aborts made while idle (no step would otherwise report them)."""
        if not self.scheduler.has_ended:
            return None
        return self.make_outputs(SchedulerOutput(), RunnerOutput(), [])


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


def _default_connector(config: EngineConfig, engine_index: int) -> KvConnector:
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
