"""Per-request state inside the engine."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

import torch

from tandem.protocol.kv_transfer import KvTransferParams
from tandem.protocol.lora import LoRARequest
from tandem.protocol.outputs import EngineCoreRequest, FinishReason, RequestError
from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()
    IDLE = enum.auto()  # a session between turns: blocks kept, not scheduled
    # Blocks allocated, their KV being pulled from another engine (kv_transfer/):
    # not in the waiting queue, takes no step; back in it once the load ends.
    WAITING_FOR_REMOTE_KV = enum.auto()


class RequestTimes:
    """When things happened to one request in this engine, for metrics and tracing.

    Times are ``time.monotonic()`` seconds, taken by the scheduler as events happen (once
    per step, not per request); ``wall()`` maps one to epoch seconds through the
    wall-clock offset sampled when the request arrived. Prefill chunks are recorded
    until the first token (recompute after a preemption is not a prefill chunk).
    """

    __slots__ = (
        "arrival",
        "finished",
        "first_scheduled",
        "first_token",
        "preemptions",
        "prefill_chunks",
        "wall_offset",
    )

    def __init__(self, arrival: float | None = None) -> None:
        now = time.monotonic()
        self.wall_offset = time.time() - now
        self.arrival = now if arrival is None else arrival
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.finished: float | None = None
        self.prefill_chunks: list[tuple[float, float, int]] = []  # (start, end, tokens)
        self.preemptions: list[float] = []

    def wall(self, t: float) -> float:
        """A monotonic time of this request as epoch seconds."""
        return t + self.wall_offset

    @property
    def queue_time(self) -> float | None:
        """Arrival -> first scheduled."""
        if self.first_scheduled is None:
            return None
        return self.first_scheduled - self.arrival

    @property
    def time_to_first_token(self) -> float | None:
        """Arrival -> first token (as seen inside the engine)."""
        if self.first_token is None:
            return None
        return self.first_token - self.arrival

    @property
    def prefill_time(self) -> float | None:
        """First scheduled -> first token."""
        if self.first_token is None or self.first_scheduled is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_time(self) -> float | None:
        """First token -> finish."""
        if self.first_token is None or self.finished is None:
            return None
        return self.finished - self.first_token

    @property
    def inference_time(self) -> float | None:
        """First scheduled -> finish."""
        if self.first_scheduled is None or self.finished is None:
            return None
        return self.finished - self.first_scheduled

    @property
    def e2e_time(self) -> float | None:
        """Arrival -> finish."""
        if self.finished is None:
            return None
        return self.finished - self.arrival


class Request:
    """One sequence being generated.

    Invariant: ``num_computed_tokens <= num_tokens + num_output_placeholders``; the
    tokens in ``[num_computed_tokens, num_tokens)`` still need a forward pass. A prompt
    chunk, a prefix-cache hit and a decode step all just move ``num_computed_tokens``.

    ``status`` changes only in ``request_lifecycle.py`` (``RequestLifecycle``).
    """

    status: RequestStatus = RequestStatus.WAITING

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        priority: int = 0,
        cache_salt: str | None = None,
        client_index: int = 0,
        trace_headers: dict[str, str] | None = None,
        received_time: float | None = None,
        timeout_s: float | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        resumable: bool = False,
        generated_token_ids: list[int] | None = None,
        kv_transfer_params: KvTransferParams | None = None,
    ) -> None:
        """``generated_token_ids``: a continuation's output so far (request migration):
        computed like a preempted request's, counted as output."""
        self.request_id = request_id
        self.resumable = resumable  # a streaming-input session: kept between turns
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.client_index = client_index
        self.trace_headers = trace_headers
        self.lora_request = lora_request
        # 0: the base model; else the adapter's id (its device slot is the LoRA manager's).
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        # Engine-side timestamps; arrival is when the engine service received it.
        self.times = RequestTimes(received_time)
        # time.monotonic() after which the client no longer waits (arrival + timeout_s).
        self.deadline: float | None = None if timeout_s is None else self.times.arrival + timeout_s

        self.output_token_ids: list[int] = list(generated_token_ids or ())
        # prompt + output; appended to as tokens are sampled.
        self.all_token_ids: list[int] = list(prompt_token_ids) + self.output_token_ids
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled on the device, counted as computed, not yet
        # read back (0 or 1; async_scheduler.py). They are in no token list.
        self.num_output_placeholders = 0
        # A session's turn, counted from 0 (``resume``): a step scheduled for an earlier
        # turn no longer applies to the request.
        self.turn = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        # Speculative decoding: steps that verified drafts, drafts verified, drafts accepted.
        self.num_spec_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: RequestError | None = None  # with FinishReason.ERROR: the status to report
        # Chained hashes of the request's full blocks, extended as tokens arrive.
        self.block_hashes: list[int] = []
        # Prompt logprobs are emitted once, on the step that completes the prefill.
        self.prompt_logprobs_pending = sampling_params.prompt_logprobs is not None
        # Prompt logprobs of the prefill chunks computed so far (sampler LogprobsTensors).
        self.prompt_logprobs_chunks: list[Any] = []
        # Structured-output state (engine_service.structured_output.StructuredRequest);
        # None for free text.
        self.structured: Any = None
        # A pooling request: one vector from the prompt's hidden states, no tokens. The
        # runner accumulates what its pooling type needs chunk by chunk (reset when a
        # preemption restarts the prompt).
        self.pooling_params = pooling_params
        self.pooling_state: torch.Tensor | None = None  # MEAN: running sum; CLS: first state
        # KV transfer (engine_service/kv_transfer): this engine's copy of the request's
        # params (the connector marks a pull as tried on it); and what a producer
        # returns in the last output.
        self.kv_transfer_params = (
            None if kv_transfer_params is None else dataclasses.replace(kv_transfer_params)
        )
        self.kv_transfer_out: KvTransferParams | None = None

    def resume(self, new_token_ids: list[int], params: SamplingParams, now: float) -> None:
        """Start a session's next turn: the history (prompt and output so far) plus
        ``new_token_ids`` is the turn's prompt. Computed tokens (and their KV) carry over
        and are reported as cached."""
        self.prompt_token_ids = self.all_token_ids + list(new_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = []
        self.sampling_params = params
        self.turn += 1
        self.finish_reason = self.stop_reason = self.error = None
        # Reported as cached: what carries over (-1, "not yet": an evicted session's
        # next turn looks its history up in the prefix cache).
        self.num_cached_tokens = self.num_computed_tokens or -1
        self.times = RequestTimes(now)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            client_index=req.client_index,
            trace_headers=req.trace_headers,
            received_time=req.received_time,
            timeout_s=req.timeout_s,
            pooling_params=req.pooling_params,
            lora_request=req.lora_request,
            resumable=req.resumable,
            generated_token_ids=req.generated_token_ids,
            kv_transfer_params=req.kv_transfer_params,
        )

    @property
    def cache_extra(self) -> str | None:
        """Mixed into the first block's prefix-cache hash: the salt, and the adapter, so
        requests of different adapters (or salts) never share KV blocks."""
        if self.lora_request is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora\x00{self.lora_request.cache_key}"

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
