"""A step's ``EngineCoreOutputs``: each scheduled request's new token (or pooled
vector), and every request that ended since the last outputs, from the scheduler's
one record of ended requests (``Scheduler.take_ended``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    IterationStats,
    Logprobs,
    TokenColumns,
)

if TYPE_CHECKING:
    from engine_service.batch import RunnerOutput
    from engine_service.scheduler import Scheduler, SchedulerOutput


class StepOutputs:
    def __init__(self, scheduler: Scheduler, engine_index: int) -> None:
        self.scheduler = scheduler
        self.engine_index = engine_index

    def empty(self) -> EngineCoreOutputs:
        """Outputs with nothing in them (a step that only launched work)."""
        return EngineCoreOutputs(engine_index=self.engine_index, scheduler_stats=self.scheduler.stats())

    def make(self, sched: SchedulerOutput, result: RunnerOutput) -> EngineCoreOutputs:
        # A request that only got its token this step (the common decode case) goes into
        # the columns: three list appends instead of one EngineCoreOutput each. This is
        # the one place token columns are built for a step.
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
            # With drafts: what the step appended (accepted drafts, then the sampled token).
            new_token_ids = entry.new_token_ids if entry.spec_token_ids else [token]
            if not new_token_ids:
                continue
            new_logprobs = logprobs.get(rid)
            if new_logprobs is not None and len(new_logprobs) > len(new_token_ids):  # a stop among the drafts
                n = len(new_token_ids)
                new_logprobs = Logprobs(new_logprobs.token_ids[:n], new_logprobs.logprobs[:n], new_logprobs.ranks[:n])
            if len(new_token_ids) == 1 and request.finish_reason is None and rid not in logprobs and rid not in prompt_logprobs:
                plain_ids.append(rid)
                plain_tokens.append(new_token_ids[0])
                plain_cached.append(request.num_cached_tokens)
                continue
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
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
        reported = set(result.sampled) | set(result.pooled) if ended else set()
        for request in ended:
            if request.request_id in reported:
                continue  # its finish reason rides on this step's output
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.finish_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    error=request.error,
                )
            )
        num_prompt_tokens, num_generation_tokens = self.scheduler.take_token_counts()
        speculator = self.scheduler.speculator
        iteration = IterationStats(
            num_prompt_tokens, num_generation_tokens, ended,
            num_scheduled_reqs=len(sched.scheduled), num_scheduled_tokens=sched.num_scheduled_tokens,
            spec_decoding=None if speculator is None else speculator.take_stats(),
        )
        return EngineCoreOutputs(
            engine_index=self.engine_index,
            outputs=outputs,
            scheduler_stats=self.scheduler.stats(),
            finished_requests={r.request_id for r in ended} or None,
            token_columns=columns,
            iteration_stats=iteration,
        )
