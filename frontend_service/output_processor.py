"""Turns engine outputs (token ids) into user-facing ``RequestOutput``s (text).

Plain Python, no asyncio and no gRPC: an async frontend routes each
``(user_request_id, RequestOutput)`` to that request's queue, and an offline, in-process
LLM calls the same processor synchronously.

Per engine request the state is a ``RequestState`` (request_state.py), per user request
a ``ParentRequest`` over its children (parent_request.py); here, the processor that
routes a step's outputs to both.

Ids: a user request with ``n`` samples becomes ``n`` engine requests. With n == 1 the
engine request id is the user request id; with n > 1 child ``i`` is ``f"{i}_{user_id}"``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from frontend_service.detokenizer import TokenTextDecoder
from frontend_service.input_processor import ProcessedRequest
from frontend_service.outputs import RequestOutput
from frontend_service.parent_request import ParentRequest
from frontend_service.request_state import RequestState
from tandem.protocol.outputs import EngineCoreOutput, EngineCoreRequest, TokenColumns
from tandem.protocol.sampling_params import InvalidRequestError


@dataclass
class ProcessedOutputs:
    """The result of feeding engine outputs (or an abort) to the OutputProcessor."""

    # (user request id, output) in the order the requests progressed.
    request_outputs: list[tuple[str, RequestOutput]] = field(default_factory=list)
    # Engine request ids the engine must abort (a stop string finished them here).
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Keeps a ``RequestState`` per engine request and a ``ParentRequest`` per user request.

    Invariant: a user request is tracked until the ``RequestOutput`` with
    ``finished=True`` has been produced (or it is aborted); engine outputs for ids it no
    longer tracks are ignored (the engine may still send a step after an abort).
    """

    def __init__(self, tokenizer: Any | None, stream_interval: int = 1) -> None:
        """``stream_interval``: tokens per DELTA/CUMULATIVE output (see ``ParentRequest``)."""
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"the stream interval must be an integer >= 1, got {stream_interval!r}")
        self.stream_interval = stream_interval
        self._tokenizer = tokenizer
        self._decoder = TokenTextDecoder(tokenizer) if tokenizer is not None else None
        self._states: dict[str, RequestState] = {}  # engine request id -> state
        self._parents: dict[str, ParentRequest] = {}  # user request id -> parent
        self._parent_of: dict[str, ParentRequest] = {}  # engine request id -> parent

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest,
        index: int,
    ) -> None:
        """Track one engine request: child ``index`` of ``parent``."""
        if request.request_id in self._states:
            raise InvalidRequestError("request_id", request.request_id, "already in use")
        known = self._parents.get(parent.request_id)
        if known is not None and known is not parent:
            raise InvalidRequestError("request_id", parent.request_id, "already in use")
        if request.sampling_params.stop and self._tokenizer is None:
            raise InvalidRequestError("stop", request.sampling_params.stop, "needs a tokenizer")
        detokenize = request.sampling_params.detokenize
        state = RequestState(request, index, self._tokenizer, self._decoder if detokenize else None)
        parent.attach(state)
        parent.prompt = prompt
        parent.prompt_token_ids = list(request.prompt_token_ids)
        self._parents[parent.request_id] = parent
        self._states[request.request_id] = state
        self._parent_of[request.request_id] = parent

    def add_processed(self, processed: ProcessedRequest) -> None:
        """Track every engine request the InputProcessor made for one user request."""
        for index, request in enumerate(processed.engine_requests):
            self.add_request(request, processed.prompt, processed.parent, index)

    def process_outputs(
        self, outputs: Iterable[EngineCoreOutput], columns: TokenColumns | None = None
    ) -> ProcessedOutputs:
        """Apply one engine step's outputs (``columns``, then ``outputs``); one
        ``RequestOutput`` per user request due."""
        result = ProcessedOutputs()
        progressed: dict[str, list[RequestState]] = {}
        if columns is not None:
            self._apply_columns(columns, result, progressed)
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue
            if state.update(output):
                result.reqs_to_abort.append(state.request_id)
            self._progressed(state, progressed)
        for user_id, states in progressed.items():
            self._emit(self._parents[user_id], states, result)
        return result

    def _apply_columns(
        self, columns: TokenColumns, result: ProcessedOutputs, progressed: dict[str, list[RequestState]]
    ) -> None:
        """The column outputs, read entry by entry from the lists: no object per request."""
        states = self._states
        token_lists = columns.token_lists() if columns.num_new_tokens is not None else None
        cached = columns.num_cached_tokens or repeat(0)
        for i, (request_id, num_cached) in enumerate(zip(columns.request_ids, cached)):
            state = states.get(request_id)
            if state is None:
                continue
            new_ids = token_lists[i] if token_lists is not None else columns.new_token_ids[i : i + 1]
            if state.add_tokens(new_ids, num_cached):
                result.reqs_to_abort.append(request_id)
            self._progressed(state, progressed)

    def _progressed(self, state: RequestState, progressed: dict[str, list[RequestState]]) -> None:
        parent = self._parent_of[state.request_id]
        progressed.setdefault(parent.request_id, []).append(state)
        if state.finished:
            self._forget(state.request_id)

    def abort_requests(self, user_request_ids: Iterable[str]) -> ProcessedOutputs:
        """Abort user requests: the final outputs (finish reason "abort") and the
        engine request ids of their unfinished children, which the engine must abort."""
        result = ProcessedOutputs()
        for user_id in user_request_ids:
            parent = self._parents.get(user_id)
            if parent is None:
                continue
            aborted = parent.abort()
            for child in aborted:
                result.reqs_to_abort.append(child.request_id)
                self._forget(child.request_id)
            self._emit(parent, aborted, result)
        return result

    def _emit(
        self, parent: ParentRequest, states: list[RequestState], result: ProcessedOutputs
    ) -> None:
        request_output = parent.make_output(states, self.stream_interval)
        if request_output is not None:
            result.request_outputs.append((parent.request_id, request_output))
        if parent.finished:
            self._parents.pop(parent.request_id, None)

    def _forget(self, engine_request_id: str) -> None:
        self._states.pop(engine_request_id, None)
        self._parent_of.pop(engine_request_id, None)

    def generated_token_ids(self, engine_request_id: str) -> list[int] | None:
        """The output tokens received so far for an unfinished engine request (what a
        continuation carries); None once it has finished or if it is unknown."""
        state = self._states.get(engine_request_id)
        return None if state is None or state.finished else list(state.token_ids)

    @property
    def user_request_ids(self) -> list[str]:
        return list(self._parents)

    def get_num_unfinished_requests(self) -> int:
        """Unfinished user requests."""
        return len(self._parents)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)
