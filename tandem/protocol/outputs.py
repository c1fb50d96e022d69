"""What goes into and comes out of an EngineCore: the domain twins of the protobuf messages.

The gRPC servicers convert these to and from ``tandem.v1`` messages at the edge; the
core never sees protobuf.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, repeat
from operator import attrgetter
from typing import Any

from tandem.protocol.kv_transfer import KvTransferParams
from tandem.protocol.lora import LoRARequest
from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished; values match the protobuf enum (0 is "not finished")."""

    STOP = 1  # EOS, a stop token or a stop string
    LENGTH = 2  # max_tokens or max_model_len reached
    ABORT = 3  # aborted by the client or the frontend
    ERROR = 4  # the engine failed while running it

    def __str__(self) -> str:
        return self.name.lower()


class ErrorCode(enum.IntEnum):
    """gRPC status codes an engine may end a request with (google.rpc.Code numbering)."""

    INVALID_ARGUMENT = 3  # the request is malformed
    DEADLINE_EXCEEDED = 4  # the request's timeout_s passed
    RESOURCE_EXHAUSTED = 8  # the engine's queue is full: another engine, or later
    INTERNAL = 13  # the engine failed while running it
    UNAVAILABLE = 14  # the engine is draining and took no new request: place it elsewhere


@dataclass
class RequestError:
    """Why an engine ended a request with FinishReason.ERROR."""

    code: ErrorCode
    message: str
    retry_after_ms: int = 0  # with RESOURCE_EXHAUSTED: expected wait; 0: no hint


@dataclass
class EngineCoreRequest:
    """A request as the engine receives it: tokens in, no text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    client_index: int = 0
    external_req_id: str | None = None
    trace_headers: dict[str, str] | None = None
    # Seconds left until the client's deadline when the frontend sent it; None: none.
    timeout_s: float | None = None
    # The LoRA adapter to run with; None: the base model.
    lora_request: LoRARequest | None = None
    # A streaming-input session turn (see engine.proto EngineCoreRequest.resumable).
    resumable: bool = False
    # A continuation: output tokens already generated elsewhere (engine.proto field 16).
    generated_token_ids: list[int] = field(default_factory=list)
    # Engine-local, never sent: time.monotonic() when the engine service received it
    # (None: when the core got it). Queue time counts from here.
    received_time: float | None = field(default=None, compare=False)
    # Set: a pooling request (one vector out, no tokens; sampling_params is unused).
    pooling_params: PoolingParams | None = None
    # Disaggregated prefill/decode (kv_transfer.proto): hold the KV for a consumer
    # (do_remote_decode), or pull it from a producer (do_remote_prefill).
    kv_transfer_params: KvTransferParams | None = None


@dataclass
class Logprobs:
    """Packed logprobs for a run of positions: row i is position i.

    Column 0 is the chosen token (sampled, or the actual next prompt token); columns
    1..k are the top-k tokens by logprob.
    """

    token_ids: list[list[int]]  # [num_positions, k + 1]
    logprobs: list[list[float]]  # [num_positions, k + 1]
    ranks: list[int]  # [num_positions] rank of the chosen token (1 = most likely)

    def __len__(self) -> int:
        return len(self.ranks)


@dataclass
class EngineCoreOutput:
    """What one request produced in one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    # Set once, on the step that finishes the request's prefill. Row i is prompt
    # position i + 1 (the first prompt token has no logprob).
    new_prompt_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id (or stop string, frontend)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    trace_headers: dict[str, str] | None = None
    error: RequestError | None = None  # set with FinishReason.ERROR: the status to report
    pooling_output: list[float] | None = None  # a pooling request's vector, in its last output
    # A producer's held KV, in the last output of a do_remote_decode request.
    kv_transfer_params: KvTransferParams | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_request_id = attrgetter("request_id")
_new_token_ids = attrgetter("new_token_ids")
_num_cached_tokens = attrgetter("num_cached_tokens")
# Positional None for the EngineCoreOutput fields between new_token_ids and
# num_cached_tokens (new_logprobs, new_prompt_logprobs, finish_reason, stop_reason).
_NONE_ARGS = (repeat(None),) * 4


@dataclass
class TokenColumns:
    """The outputs of one step's requests that carry nothing but new tokens and a
    cached-token count, as columns: entry i of each column belongs to request i.

    A plain decode step is three lists, so the engine builds it, the wire carries it
    and the frontend reads it without one object per request. Each entry means what
    ``EngineCoreOutput(request_ids[i], <its tokens>, num_cached_tokens=...)`` means;
    none of these requests finished in the step (a finished one carries a finish
    reason and travels as an EngineCoreOutput).

    Producers write None rather than an all-ones count column or an all-zero cached
    column (``from_outputs`` and ``select`` do), so equal steps compare equal.
    """

    request_ids: list[str]
    # The new tokens of all requests, concatenated in request order.
    new_token_ids: list[int]
    # Tokens per request; None: exactly one each (len(new_token_ids) == len(request_ids)).
    num_new_tokens: list[int] | None = None
    # EngineCoreOutput.num_cached_tokens per request; None: 0 for every request.
    num_cached_tokens: list[int] | None = None

    def __len__(self) -> int:
        return len(self.request_ids)

    def token_lists(self) -> list[list[int]]:
        """The new tokens of each request, one list per request."""
        tokens = self.new_token_ids
        counts = self.num_new_tokens
        if counts is None:
            return [[t] for t in tokens]
        ends = list(accumulate(counts))
        return list(map(tokens.__getitem__, map(slice, [0, *ends[:-1]], ends)))

    def cached_counts(self) -> list[int]:
        """num_cached_tokens of each request."""
        cached = self.num_cached_tokens
        return [0] * len(self.request_ids) if cached is None else cached

    def to_outputs(self) -> list[EngineCoreOutput]:
        """One EngineCoreOutput per request (for readers that want objects)."""
        ids, tokens = self.request_ids, self.token_lists()
        if self.num_cached_tokens is None:
            return list(map(EngineCoreOutput, ids, tokens))
        return list(map(EngineCoreOutput, ids, tokens, *_NONE_ARGS, self.num_cached_tokens))

    def select(self, keep: list[bool]) -> TokenColumns:
        """The requests whose entry in ``keep`` is true, in order."""
        counts = self.num_new_tokens
        if counts is None:
            tokens = list(compress(self.new_token_ids, keep))
        else:
            tokens = list(chain.from_iterable(compress(self.token_lists(), keep)))
            counts = list(compress(counts, keep))
        cached = self.num_cached_tokens
        if cached is not None:
            cached = list(compress(cached, keep))
        return TokenColumns(
            list(compress(self.request_ids, keep)),
            tokens,
            None if counts is None or counts.count(1) == len(counts) else counts,
            cached if cached and any(cached) else None,
        )

    @classmethod
    def from_outputs(cls, outputs: list[EngineCoreOutput]) -> TokenColumns:
        """Columns of outputs the caller checked to carry only tokens and a cached count;
        the one-token-each and all-zero columns become None."""
        tokens = list(map(_new_token_ids, outputs))
        counts = list(map(len, tokens))
        cached = list(map(_num_cached_tokens, outputs))
        return cls(
            list(map(_request_id, outputs)),
            list(chain.from_iterable(tokens)),
            None if counts.count(1) == len(counts) else counts,
            cached if any(cached) else None,
        )

    def concat(self, other: TokenColumns) -> TokenColumns:
        """These requests followed by ``other``'s."""
        def full(cols: TokenColumns) -> list[int]:
            return [1] * len(cols) if cols.num_new_tokens is None else cols.num_new_tokens

        one_each = self.num_new_tokens is None and other.num_new_tokens is None
        no_cache = self.num_cached_tokens is None and other.num_cached_tokens is None
        return TokenColumns(
            self.request_ids + other.request_ids,
            self.new_token_ids + other.new_token_ids,
            None if one_each else full(self) + full(other),
            None if no_cache else self.cached_counts() + other.cached_counts(),
        )


@dataclass
class SchedulerStats:
    """The scheduler's state after one step; load balancing and metrics read it."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, [0, 1]
    prefix_cache_queries: int = 0  # prompt tokens looked up this step
    prefix_cache_hits: int = 0  # of which found in the cache
    num_preemptions: int = 0  # preemptions this step
    num_free_blocks: int = 0
    num_total_blocks: int = 0


@dataclass
class IterationStats:
    """Engine-local, never sent: what one step did, for metrics, the stats log and tracing."""

    # Prompt tokens of the requests that produced their first token this step.
    num_prompt_tokens: int = 0
    # Tokens sampled this step.
    num_generation_tokens: int = 0
    # The requests that finished this step (aborts included): engine_service.request.Request
    # objects the core no longer touches, with their RequestTimes filled in.
    finished: list[Any] = field(default_factory=list)
    # The step's batch: requests scheduled and tokens computed (prefill chunks + decodes).
    num_scheduled_reqs: int = 0
    num_scheduled_tokens: int = 0
    # Speculative decoding's counters of this step (engine_service.spec_decode.speculator.
    # SpecDecodingStats); None: nothing verified.
    spec_decoding: Any = None


@dataclass
class UtilityOutput:
    """The answer to a utility call: a result or a failure message."""

    call_id: int
    result: Any = None
    failure_message: str | None = None


@dataclass
class EngineCoreOutputs:
    """Everything one engine step produced, for all requests of one client.

    Each request that produced something is in exactly one of ``token_columns`` (only
    new tokens: the common decode step) and ``outputs`` (anything else); the engine
    puts every plain one in the columns. ``all_outputs()`` gives both as objects.
    """

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = field(default_factory=time.monotonic)
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    draining: bool = False  # the engine takes no new requests (graceful shutdown)
    token_columns: TokenColumns | None = None  # the outputs with only new tokens; None: none
    iteration_stats: IterationStats | None = field(default=None, compare=False)  # engine-local
    num_steps: int = 1  # engine steps reported here (merge_steps); 1 unless merged

    def all_outputs(self) -> list[EngineCoreOutput]:
        """Every output as an object: the column ones first, then ``outputs``."""
        if self.token_columns is None:
            return list(self.outputs)
        return self.token_columns.to_outputs() + self.outputs

    @property
    def num_outputs(self) -> int:
        """Requests that produced something in this step (columns and outputs)."""
        return len(self.outputs) + (0 if self.token_columns is None else len(self.token_columns))

    @classmethod
    def refusal(
        cls, engine_index: int, request_id: str, error: RequestError, draining: bool = False
    ) -> EngineCoreOutputs:
        """The step that ends ``request_id`` at arrival: one ERROR output carrying ``error``."""
        out = EngineCoreOutput(
            request_id, [], finish_reason=FinishReason.ERROR, stop_reason=error.message, error=error
        )
        return cls(engine_index, [out], finished_requests={request_id}, draining=draining)


class UnmergeableError(ValueError):
    """Two steps' outputs of one request cannot be told as one (their logprob rows
    would no longer line up with their tokens, or a finished request went on)."""


def merge_steps(steps: list[EngineCoreOutputs]) -> EngineCoreOutputs:
    """Consecutive steps' outputs for one client as one ``EngineCoreOutputs``: each
    request once, with the tokens of every step in order; the last step's stats,
    timestamp and draining flag. Raises UnmergeableError where that would lose
    information (the caller then sends the steps as they are). No utility outputs.

    The steps' own objects are not changed."""
    if len(steps) == 1:
        return steps[0]
    # request id -> [tokens, num_cached_tokens] (a column entry) or an EngineCoreOutput
    merged: dict[str, list[Any] | EngineCoreOutput] = {}
    finished: set[str] = set()
    for step in steps:
        if step.utility_output is not None:
            raise UnmergeableError("a utility output is never merged")
        cols = step.token_columns
        if cols is not None:
            for rid, tokens, cached in zip(cols.request_ids, cols.token_lists(), cols.cached_counts()):
                known = merged.get(rid)
                if known is None:
                    merged[rid] = [tokens, cached]
                elif isinstance(known, list):
                    known[0] = known[0] + tokens
                    known[1] = max(known[1], cached)
                else:
                    merged[rid] = _merge_output(known, EngineCoreOutput(rid, tokens, num_cached_tokens=cached))
        for out in step.outputs:
            known = merged.get(out.request_id)
            if known is None:
                merged[out.request_id] = out
                continue
            if isinstance(known, list):
                known = EngineCoreOutput(out.request_id, known[0], num_cached_tokens=known[1])
            merged[out.request_id] = _merge_output(known, out)
        if step.finished_requests:
            finished |= step.finished_requests
    ids: list[str] = []
    tokens: list[list[int]] = []
    cached: list[int] = []
    outputs: list[EngineCoreOutput] = []
    for rid, entry in merged.items():
        if isinstance(entry, list):
            ids.append(rid)
            tokens.append(entry[0])
            cached.append(entry[1])
        else:
            outputs.append(entry)
    columns = None
    if ids:
        counts = list(map(len, tokens))
        columns = TokenColumns(
            ids,
            list(chain.from_iterable(tokens)),
            None if counts.count(1) == len(counts) else counts,
            cached if any(cached) else None,
        )
    last = steps[-1]
    return EngineCoreOutputs(
        engine_index=last.engine_index,
        outputs=outputs,
        scheduler_stats=last.scheduler_stats,
        timestamp=last.timestamp,
        finished_requests=finished or None,
        draining=last.draining,
        token_columns=columns,
        num_steps=sum(s.num_steps for s in steps),
    )


def _merge_output(first: EngineCoreOutput, then: EngineCoreOutput) -> EngineCoreOutput:
    """One request's outputs of two consecutive steps as one."""
    if first.finished:
        raise UnmergeableError(f"request {first.request_id} produced output after it finished")
    if first.pooling_output is not None or then.pooling_output is not None:
        raise UnmergeableError("pooling outputs are never merged")
    lp_first, lp_then = first.new_logprobs, then.new_logprobs
    if (lp_first is None) != (lp_then is None) and (first.new_token_ids and then.new_token_ids):
        raise UnmergeableError("logprobs in one step and not in the other")
    logprobs = lp_first or lp_then
    if lp_first is not None and lp_then is not None:
        logprobs = Logprobs(
            lp_first.token_ids + lp_then.token_ids, lp_first.logprobs + lp_then.logprobs,
            lp_first.ranks + lp_then.ranks,
        )
    if first.new_prompt_logprobs is not None and then.new_prompt_logprobs is not None:
        raise UnmergeableError("prompt logprobs in two steps")
    return EngineCoreOutput(
        request_id=first.request_id,
        new_token_ids=first.new_token_ids + then.new_token_ids,
        new_logprobs=logprobs,
        new_prompt_logprobs=first.new_prompt_logprobs or then.new_prompt_logprobs,
        finish_reason=then.finish_reason,
        stop_reason=then.stop_reason,
        num_cached_tokens=max(first.num_cached_tokens, then.num_cached_tokens),
        trace_headers=then.trace_headers or first.trace_headers,
        error=then.error,
        kv_transfer_params=then.kv_transfer_params,
    )
