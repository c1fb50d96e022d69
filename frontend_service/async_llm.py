"""AsyncLLM: the frontend's engine-facing core, as vLLM's AsyncLLM but over gRPC.

``generate()`` validates and tokenizes a request, places it on an engine, and yields
``RequestOutput``s as the engine's per-step outputs arrive; closing the generator (a
client cancel or disconnect) aborts the engine request. Text work (detokenization,
stop strings, n>1) happens in the shared ``OutputProcessor``. A caller that reads
slower than the engine steps gets the outputs queued meanwhile as one (deltas merged),
so a lagging stream costs one message per read, not one per engine step.

Shape: AsyncLLM owns generation and the engine callbacks (``on_engine_outputs``,
``on_engine_dead``: outputs routed to streams, failed requests moved or failed). Every
other concern is a component built in ``__init__`` and given exactly its collaborators:

* ``streams`` (StreamTable, streams.py): the live streams, shared by all components;
* ``gate`` (RequestGate, admission.py): admission and the pause, at every request's entry;
* ``control`` (RequestControl, control.py): abort by id, pause / resume, drain;
* ``utilities`` (EngineUtilities, utilities.py): sleep, profiling, collective_rpc, ...;
* ``migration`` (StreamMigration, migration.py): streams of a lost engine move on;
* ``disaggregation`` (DisaggregatedPrefill, disaggregation.py): prefill, then decode elsewhere;
* ``pooling`` (PoolingRequests, pooling.py): ``encode``;
* ``sessions`` (StreamingInputSessions, sessions.py): streaming-input sessions;
* ``observation`` (RequestObservation, observability.py; None without metrics and
  tracing): the request's span and its latency metrics;
* ``loras`` (LoraRegistry, lora.py): LoRA adapters by name.

The public methods with vLLM's names (``encode``, ``abort``, ``pause``, ``sleep``,
``add_lora``, ...) delegate to those components.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Self

from frontend_service.admission import PendingLimit, RequestFailedError, RequestGate
from frontend_service.control import PauseMode, RequestControl
from frontend_service.disaggregation import DisaggregatedPrefill
from frontend_service.engine_client import EngineConnection, EngineUnavailableError
from frontend_service.engine_group import EngineGroup
from frontend_service.input_processor import InputProcessor, ProcessedRequest
from frontend_service.lora import LoraRegistry
from frontend_service.metrics import FrontendMetrics
from frontend_service.migration import MigrationConfig, MigrationReason, StreamMigration
from frontend_service.observability import RequestObservation
from frontend_service.output_processor import OutputProcessor
from frontend_service.outputs import PoolingRequestOutput, RequestOutput, merge_request_outputs
from frontend_service.pooling import PoolingRequests
from frontend_service.sessions import SessionChunk, StreamingInputSessions, as_session_chunks
from frontend_service.streams import Stream, StreamTable, request_ids, send
from frontend_service.utilities import EngineUtilities
from tandem.protocol.lora import LoRARequest
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ErrorCode,
    FinishReason,
    RequestError,
)
from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import RequestOutputKind, SamplingDefaults, SamplingParams
from tandem.telemetry import Tracing

# Refusals of a request an engine has not started: another engine may take it.
_MOVABLE = (ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE)


class AsyncLLM:
    def __init__(
        self,
        tokenizer: Any,
        engines: EngineGroup,
        input_processor: InputProcessor,
        client_index: int = 0,
        *,
        model_name: str = "",
        metrics: FrontendMetrics | None = None,
        tracing: Tracing | None = None,
        admission: PendingLimit | None = None,
        migration: MigrationConfig | None = None,
        disaggregated: bool = False,
        stream_interval: int = 1,
        sampling_defaults: SamplingDefaults | None = None,
    ) -> None:
        """``admission``: the bound on requests in progress (None: unbounded);
        ``migration``: what happens to requests of a lost engine (default: they move on);
        ``disaggregated``: prefill on a producer engine, decode on a consumer
        (disaggregation.py); ``stream_interval``: tokens per streamed output
        (``OutputFlow.stream_interval``)."""
        self.tokenizer = tokenizer
        # The model's own sampling settings, for what a request leaves unset (the edges apply them).
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.engines = engines
        self.input_processor = input_processor
        self.output_processor = OutputProcessor(tokenizer, stream_interval)
        self.client_index = client_index
        self.admission = admission
        self.closed = False  # shutdown() was called

        self.streams = StreamTable(self.output_processor)
        self.gate = RequestGate(admission)
        self.control = RequestControl(self.streams, self.output_processor, self.gate)
        self.utilities = EngineUtilities(engines, self.control)
        self.migration = StreamMigration(
            migration or MigrationConfig(), engines, self.streams, self.output_processor, metrics
        )
        self.disaggregation = DisaggregatedPrefill(disaggregated, engines, self.streams, self.output_processor)
        self.pooling = PoolingRequests(input_processor, engines, self.streams, self.gate, client_index)
        self.sessions = StreamingInputSessions(
            input_processor, self.output_processor, engines, self.streams, self.gate, client_index
        )
        observed = metrics is not None or tracing is not None
        self.observation = RequestObservation(metrics, tracing, model_name) if observed else None
        self.loras = LoraRegistry(engines)  # LoRA adapters across the engines, by name

    # ---- engine callbacks (run on the event loop) ----------------------------------

    def on_engine_outputs(self, engine: EngineConnection, outs: EngineCoreOutputs) -> None:
        outputs = outs.outputs
        columns = outs.token_columns
        streams = self.streams
        disaggregation = self.disaggregation
        handoffs = disaggregation.take_finished(engine, outputs) if disaggregation.in_progress and outputs else None
        if outputs and (streams.moved or any(o.finish_reason == FinishReason.ERROR for o in outputs)):
            outputs = self._route_failures(engine, outputs)
        if columns is not None and streams.moved:
            columns = streams.drop_stale_columns(engine, columns)
        if not outputs and columns is None:
            return
        if self.pooling.in_flight and outputs:
            outputs = self.pooling.take_pooled(outputs)
        if self.observation is not None:
            self.observation.on_tokens(outputs, columns)
        processed = self.output_processor.process_outputs(outputs, columns)
        outputs_round = getattr(engine, "outputs_round", None)
        by_id = streams.by_id
        for internal_id, request_output in processed.request_outputs:
            stream = by_id.get(internal_id)
            if stream is not None:
                stream.got_output = True
                stream.finished = request_output.finished
                stream.queue.put_nowait(request_output)
                # A stream still writing an earlier round's output (a client that reads
                # slowly) does not hold up this one: its outputs merge in its queue.
                if outputs_round is not None and not stream.rounds:
                    outputs_round.join()
                    stream.rounds.append(outputs_round)
        if processed.reqs_to_abort:
            engine.abort(processed.reqs_to_abort)  # stop strings matched
        for request_id, params in handoffs or ():
            disaggregation.hand_off(engine, request_id, params)  # prefill done: decode elsewhere

    def on_engine_dead(self, engine: EngineConnection, reason: str) -> None:
        """Move every request of the dead engine to another one (migration.py), or fail
        it with UNAVAILABLE where it cannot move; others keep going."""
        lost = [(rid, s) for rid, s in self.streams.unfinished() if s.engine is engine]
        for internal_id, stream in lost:
            if not self.migration.migrate(internal_id, stream, MigrationReason.ENGINE_DEAD, reason):
                self.streams.fail(internal_id, stream, EngineUnavailableError(reason))

    # ---- failed requests: another engine, or the caller gets the status --------------

    def _route_failures(
        self, engine: EngineConnection, outputs: list[EngineCoreOutput]
    ) -> list[EngineCoreOutput]:
        """Handle the ERROR outputs; return the rest, minus stale outputs of moved requests."""
        kept = []
        for out in outputs:
            if out.finish_reason == FinishReason.ERROR:
                self._on_request_failed(engine, out)
            elif not self.streams.is_stale(out.request_id, engine):
                kept.append(out)
        return kept

    def _on_request_failed(self, engine: EngineConnection, out: EngineCoreOutput) -> None:
        """An engine ended one of a stream's requests with an error.

        Refused before any output (RESOURCE_EXHAUSTED: its queue is full; UNAVAILABLE: it
        started draining while the add was on the wire): the stream moves to the
        least-loaded live engine it has not tried yet (each engine at most once), and its
        caller never sees the refusal. UNAVAILABLE after output (the engine's drain
        timeout ended it): the stream migrates. Anything else, or no engine left: the
        caller gets the engine's status.
        """
        found = self.streams.find(out.request_id)
        if found is None:
            return
        internal_id, stream = found
        if stream.finished or stream.engine is not engine:
            return
        error = out.error or RequestError(
            ErrorCode.INTERNAL, f"the engine failed this request: {out.stop_reason or 'no reason given'}"
        )
        if error.code in _MOVABLE and not stream.got_output:
            target = self._next_engine(stream)
            if target is not None:
                engine.abort([rid for rid in stream.engine_request_ids if rid != out.request_id])
                stream.engine = target
                self.streams.mark_moved(stream)
                try:
                    send(stream, target)
                except (RequestFailedError, EngineUnavailableError) as exc:
                    self.streams.fail(internal_id, stream, exc)
                return
        drained = error.code == ErrorCode.UNAVAILABLE and stream.got_output
        if drained and self.migration.migrate(internal_id, stream, MigrationReason.ENGINE_DRAINED, error.message):
            return
        self.streams.fail(internal_id, stream, RequestFailedError(error))

    def _next_engine(self, stream: Stream) -> EngineConnection | None:
        try:
            return self.engines.pick(stream.requests[0], exclude=stream.tried)
        except EngineUnavailableError:
            return None

    # ---- generation ----------------------------------------------------------------

    async def generate(
        self,
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        trace_headers: dict[str, str] | None = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        timeout_s: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs of one request; its ``request_id`` is the caller's id.

        ``timeout_s``: seconds until the caller stops waiting (a gRPC deadline). The
        engine drops or aborts the request once they have passed, and this raises
        ``RequestFailedError`` with DEADLINE_EXCEEDED. Over the frontend's bound on
        requests in progress, or when every engine refused it, it raises one with
        RESOURCE_EXHAUSTED and a retry hint.

        ``add_special_tokens`` / ``add_generation_prompt``: see ``InputProcessor.process``.
        ``trace_headers``: the caller's W3C ``traceparent``/``tracestate``. With tracing
        on, the request's span continues that trace and the engine gets the span's own
        context instead; with tracing off they are passed on to the engine as they are.
        """
        if self.closed:
            raise EngineUnavailableError("this AsyncLLM was shut down")
        if prompt is not None and not isinstance(prompt, str) and hasattr(prompt, "__aiter__"):
            # Streaming input (the reference's): chunks of a session, one turn each.
            chunks = as_session_chunks(prompt, sampling_params)
            async for out in self.sessions.generate(
                chunks, request_id=request_id, priority=priority, trace_headers=trace_headers, timeout_s=timeout_s
            ):
                yield out
            return
        arrival = time.monotonic()
        observation = self.observation
        span = None
        failure: BaseException | None = None
        if observation is not None:
            span, trace_headers = observation.start_span(trace_headers, chat=messages is not None)
        processed: ProcessedRequest | None = None
        admitted = False
        gate = self.gate
        if lora_request is not None:
            lora_request = self.loras.resolve(lora_request)
        try:
            admitted = gate.admit()
            await gate.wait_open()
            user_id, internal_id = request_ids(request_id)
            processed = self.input_processor.process(
                internal_id,
                sampling_params,
                prompt=prompt,
                prompt_token_ids=prompt_token_ids,
                messages=messages,
                priority=priority,
                cache_salt=cache_salt,
                client_index=self.client_index,
                trace_headers=trace_headers,
                add_special_tokens=add_special_tokens,
                add_generation_prompt=add_generation_prompt,
                lora_request=lora_request,
            )
            if observation is not None:
                observation.add_sequences(processed, arrival)
            prefill = self.disaggregation.engine_for(processed)
            engine = prefill or self.engines.pick(processed.engine_requests[0])
            stream = Stream(
                asyncio.Queue(), engine, [r.request_id for r in processed.engine_requests],
                requests=processed.engine_requests,
                deadline=None if timeout_s is None else arrival + timeout_s,
                span=span,
            )
            self.output_processor.add_processed(processed)
            self.streams.track(internal_id, stream)
            try:
                if prefill is not None:
                    self.disaggregation.send(stream, prefill)
                else:
                    send(stream, engine)
                delta = processed.sampling_params.output_kind == RequestOutputKind.DELTA
                pending: RequestOutput | BaseException | None = None
                while True:
                    item = pending if pending is not None else await stream.queue.get()
                    pending = None
                    if isinstance(item, BaseException):
                        raise item
                    # A reader that fell behind gets what has queued up as one output.
                    while not item.finished and not stream.queue.empty():
                        later = stream.queue.get_nowait()
                        if isinstance(later, BaseException):
                            pending = later
                            break
                        item = merge_request_outputs(item, later, delta)
                    item.request_id = user_id
                    yield item  # returns once the caller took it (a gRPC write completed)
                    stream.leave_rounds()
                    if item.finished:
                        return
            finally:
                stream.leave_rounds()
                self.streams.untrack(internal_id, stream)
                self.disaggregation.forget(stream)
                if not stream.finished:
                    # Cancelled, disconnected, failed or closed early: free the engine's blocks.
                    result = self.output_processor.abort_requests([internal_id])
                    stream.engine.abort(result.reqs_to_abort or stream.engine_request_ids)
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the caller went away: finish reason "abort", not an error
        except BaseException as exc:
            failure = exc
            raise
        finally:
            gate.leave(admitted)
            if observation is not None:
                observation.finish(processed, arrival, span, failure)

    # ---- vLLM's API beyond generate, delegated to the components --------------------

    def encode(
        self,
        pooling_params: PoolingParams | None = None,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
        add_special_tokens: bool | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Yield the one output of a pooling request; see ``PoolingRequests.encode``."""
        return self.pooling.encode(
            pooling_params, prompt=prompt, prompt_token_ids=prompt_token_ids, request_id=request_id,
            priority=priority, trace_headers=trace_headers, add_special_tokens=add_special_tokens,
            timeout_s=timeout_s,
        )

    def generate_session(
        self,
        inputs: AsyncIterator[SessionChunk],
        *,
        request_id: str | None = None,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield each turn's outputs of a streaming-input session; see
        ``StreamingInputSessions.generate``."""
        return self.sessions.generate(
            inputs, request_id=request_id, priority=priority, trace_headers=trace_headers, timeout_s=timeout_s
        )

    def abort(self, request_ids: Sequence[str]) -> int:
        return self.control.abort(request_ids)

    @property
    def paused(self) -> bool:
        return self.control.paused

    async def pause(self, mode: PauseMode, poll_interval: float = 0.05) -> None:
        await self.control.pause(mode, poll_interval)

    def resume(self) -> None:
        self.control.resume()

    @property
    def num_unfinished(self) -> int:
        return self.control.num_unfinished

    async def drain(self, timeout: float, poll_interval: float = 0.05) -> int:
        return await self.control.drain(timeout, poll_interval)

    def fail_all(self, reason: str) -> int:
        return self.control.fail_all(reason)

    async def sleep(self, level: int = 1) -> None:
        await self.utilities.sleep(level)

    async def wake_up(self) -> None:
        await self.utilities.wake_up()

    async def is_sleeping(self) -> bool:
        return await self.utilities.is_sleeping()

    async def reset_prefix_cache(self) -> int:
        return await self.utilities.reset_prefix_cache()

    async def start_profile(self) -> None:
        await self.utilities.start_profile()

    async def stop_profile(self) -> list[str]:
        return await self.utilities.stop_profile()

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return await self.utilities.collective_rpc(method, args)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return await self.utilities.get_supported_tasks()

    async def check_health(self) -> None:
        await self.utilities.check_health()

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300.0) -> None:
        await self.utilities.wait_for_requests_to_drain(drain_timeout)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self.loras.add_lora(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.loras.remove_lora(lora_id)

    async def list_loras(self) -> set[int]:
        return await self.loras.list_loras()

    async def pin_lora(self, lora_id: int) -> bool:
        return await self.loras.pin_lora(lora_id)

    # ---- lifetime --------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Fail what is still running (UNAVAILABLE) and close the engine connections;
        idempotent (vLLM's ``AsyncLLM.shutdown``; also ``async with AsyncLLM(...)``)."""
        if self.closed:
            return
        self.closed = True
        self.control.fail_all("the AsyncLLM was shut down")
        await self.engines.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()
