"""EngineCore: the step loop of one engine, schedule -> execute -> update -> outputs.

The core is composed of explicit parts, each given its collaborators when built:

- ``startup.start_up``: the model, the KV cache, scheduler, runner, structured output,
  admission, step observer and profiler (``EngineParts``), stored on the core as
  attributes of the same names;
- ``validation.RequestValidator``: every field of a request checked before it is queued;
- ``sleep_mode.SleepController``: sleep / wake_up, given the runner, KV manager,
  scheduler, LoRA manager, executor and start-up's reload and KV-allocation steps;
- ``lora.engine_api.LoRAUtilities``: the adapter utility calls and a request's adapter;
- ``engine_step.SyncStep`` or, with async scheduling, ``engine_step.AsyncStep``: the step.

The core's own methods queue requests and run steps; the rest delegate to those parts.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from engine_service.admission import (
    RequestRejected,
    deadline_error,
)
from engine_service.batch import RunnerOutput
from engine_service.config import EngineConfig
from engine_service.cpu import cpu_quota, default_num_threads, keep_freed_memory_mapped
from engine_service.distributed.executor import TensorParallelExecutor
from engine_service.kv_transfer import KvConnector, NoConnector
from engine_service.lora.engine_api import LoRAUtilities
from engine_service.request import Request
from engine_service.scheduler import SchedulerOutput
from engine_service.sleep_mode import SleepController
from engine_service.startup import Tracer, default_connector, start_up
from engine_service.thread_governor import ThreadGovernor
from engine_service.validation import RequestValidator
from tandem.model_source import resolve_model
from tandem.protocol.lora import LoRARequest
from tandem.protocol.outputs import (
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    RequestError,
)
from tandem.protocol.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)


class EngineCore:
    """One engine: model, KV cache, scheduler. Not thread-safe: one thread drives it
    (``validate_request`` excepted).

    ``EngineCoreLoop`` (core_loop.py) puts a thread and queues around it for services.
    """

    supported_tasks: tuple[str, ...] = ("generate", "embed")  # vLLM's get_supported_tasks()

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int = 0,
        tracer: Tracer | None = None,
        kv_connector: KvConnector | None = None,
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
            parts = start_up(config, engine_index, self.executor, self.governor, self.kv_connector, tracer)
        except BaseException:
            self.shutdown(graceful=False)  # no worker outlives a failed start-up
            raise
        self.model_config = parts.model_config
        self.max_model_len = parts.max_model_len
        self.num_blocks = parts.num_blocks
        self.lora = parts.lora  # the LoRAManager; None without --enable-lora
        self.kv_manager = parts.kv_manager
        self.scheduler = parts.scheduler
        self.structured = parts.structured
        self.runner = parts.runner
        self.admission = parts.admission
        self.observer = parts.observer
        self.profiler = parts.profiler
        self.engine_step = parts.step
        self.outputs = parts.outputs
        self.validator = RequestValidator(
            self.model_config, self.max_model_len, config.max_logprobs, lora_enabled=self.lora is not None
        )
        self.lora_utilities = LoRAUtilities(self.lora, self.scheduler.running_lora_ids)
        self.sleep_mode = SleepController(
            config, engine_index, self.runner, self.kv_manager, self.scheduler, self.lora, self.executor,
            load_model=parts.load_model, allocate_kv_caches=parts.allocate_kv_caches,
            busy=self.has_unfinished_requests,
        )

    @property
    def model(self) -> torch.nn.Module:
        """The model (rank 0's shard with tensor parallelism): the runner's, so None while
        asleep at level 2 and after shutdown."""
        return self.runner.model

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

    def validate_request(self, req: EngineCoreRequest) -> None:
        """Raise InvalidRequestError naming the bad field; safe to call from any thread."""
        self.validator.validate(req)

    def _queue(self, req: EngineCoreRequest, admission: bool) -> None:
        if self.sleep_mode.is_sleeping():
            raise RequestRejected(
                RequestError(ErrorCode.UNAVAILABLE, "the engine is asleep (sleep mode): wake it up first")
            )
        rid = req.request_id
        if req.resumable and self.scheduler.has_session(rid):
            # A session's next turn: its new tokens queue like a new request's.
            if admission:
                self._check_admission(len(req.prompt_token_ids))
            self.validator.validate_session_turn(req, self.scheduler.session_num_tokens(rid))
            self.scheduler.resume(rid, list(req.prompt_token_ids), req.sampling_params)
            return
        self.validator.validate(req)
        if req.kv_transfer_params is not None and isinstance(self.kv_connector, NoConnector):
            # As the reference: the request runs, its transfer is dropped.
            logger.warning(
                "request %s has kv_transfer_params but this engine has no KV connector "
                "(--kv-role): ignored", rid,
            )
            req.kv_transfer_params = None
        if self.scheduler.has_request(rid):
            raise InvalidRequestError("request_id", rid, "a request with this id is running")
        if req.lora_request is not None:
            req.lora_request = self.lora_utilities.resolve(req.lora_request)
        request = Request.from_engine_core_request(req)
        if request.deadline is not None and request.deadline <= time.monotonic():
            raise RequestRejected(deadline_error("the request's deadline passed before it was queued"))
        if admission:
            self._check_admission(request.num_tokens)
        self.structured.submit(request)  # a constraint starts compiling now
        self.scheduler.add_request(request)

    def _check_admission(self, num_new_tokens: int) -> None:
        """RequestRejected(RESOURCE_EXHAUSTED) when queueing ``num_new_tokens`` more would
        cross the waiting queue's bounds (admission.py)."""
        self.admission.check(self.scheduler.num_waiting, self.scheduler.num_waiting_tokens, num_new_tokens)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in any state; their blocks are free on return."""
        self.scheduler.abort(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        """Requests in the engine, or (async scheduling) a step whose outputs are not out yet."""
        return self.scheduler.num_unfinished > 0 or self.engine_step.busy

    def reset_prefix_cache(self) -> int:
        return self.kv_manager.reset_prefix_cache()

    # ---- sleep mode (sleep_mode.py) ---------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Give back memory while idle (``SleepController.sleep``); requests that arrive
        while asleep are refused with UNAVAILABLE. Raises EngineBusyError while requests
        are unfinished."""
        self.sleep_mode.sleep(level)

    def wake_up(self) -> None:
        self.sleep_mode.wake_up()

    def is_sleeping(self) -> bool:
        return self.sleep_mode.is_sleeping()

    @property
    def sleep_level(self) -> int:
        """0: awake; 1: KV cache released; 2: weights released too."""
        return self.sleep_mode.level

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache tensors hold now (0 while asleep)."""
        return self.sleep_mode.kv_cache_bytes

    # ---- LoRA adapters (lora/engine_api.py) -------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter for later requests; True if it was new."""
        return self.lora_utilities.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.lora_utilities.remove_lora(lora_id)

    def list_loras(self) -> list[int]:
        return self.lora_utilities.list_loras()

    def lora_requests(self) -> list[LoRARequest]:
        """Every registered adapter, by id (what frontends learn names from)."""
        return self.lora_utilities.lora_requests()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter in a device slot (never evicted)."""
        return self.lora_utilities.pin_lora(lora_id)

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, update request state, and report what happened
        (engine_step.py: one step, or under async scheduling one step's outputs)."""
        return self.engine_step.step()

    def idle_tick(self) -> None:
        """Housekeeping while no request runs (the loop calls it when woken or every
        second): held KV transfers pulled or expired give their blocks back."""
        self.scheduler.idle_tick()

    def check_health(self) -> None:
        """Raise WorkerDiedError when a tensor-parallel worker died (the core is dead)."""
        if self.executor is not None:
            self.executor.check_alive()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel workers, if any (TensorParallelExecutor.shutdown: joined,
        process group destroyed), the structured-output threads, and let go of the CUDA
        graphs, KV cache and weights (huge-page and CUDA memory return once the last
        tensor goes). Idempotent; the core is unusable afterwards. Also the clean-up of a
        failed start-up (``start_up`` closed what it built), so only ``executor`` and
        ``kv_connector`` may be set then."""
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
            runner.model = None  # the core's ``model`` is the runner's
        if torch.cuda.is_available() and self.config.torch_device.type == "cuda":
            torch.cuda.empty_cache()

    def take_ended_outputs(self) -> EngineCoreOutputs | None:
        """Outputs for requests that ended while no step ran (aborts, expired deadlines),
        which no step would otherwise report; None: there are none."""
        if not self.scheduler.has_ended:
            return None
        return self.outputs.make(SchedulerOutput(), RunnerOutput())
