"""EngineCore: the step loop of one engine, schedule -> execute -> update -> outputs."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from engine_service.admission import (
    RequestRejected,
    deadline_exceeded,
)
from engine_service.config import EngineConfig
from engine_service.cpu import cpu_quota, default_num_threads, keep_freed_memory_mapped
from engine_service.distributed.executor import TensorParallelExecutor, WorkerDiedError
from engine_service.kv_transfer import KvConnector, NoConnector
from engine_service.lora.engine_api import LoRAUtilities
from engine_service.model_runner import (
    RunnerOutput,
)
from engine_service.request import Request
from engine_service.scheduler import SchedulerOutput
from engine_service.sessions import Sessions
from engine_service.sleep_mode import SleepMode
from engine_service.startup import EngineStartUp, default_connector
from engine_service.thread_governor import ThreadGovernor
from engine_service.validation import RequestValidation
from tandem.model_source import resolve_model
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


class EngineCore(EngineStartUp, SleepMode, Sessions, RequestValidation, LoRAUtilities):
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
        # --model as named (a GGUF file, "demo", "" for the default) -> its checkpoint directory.
        config = dataclasses.replace(
            config, model=resolve_model(config.model), tokenizer=resolve_model(config.tokenizer) if config.tokenizer else ""
        )
        self.config = config
        self.engine_index = engine_index
        self.kv_connector = kv_connector or default_connector(config, engine_index)
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
