"""Turns engine outputs (token ids) into user-facing ``RequestOutput``s (text).

Plain Python, no asyncio and no gRPC: an async frontend routes each
``(user_request_id, RequestOutput)`` to that request's queue, and an offline, in-process
LLM calls the same processor synchronously.

Ids: a user request with ``n`` samples becomes ``n`` engine requests. With n == 1 the
engine request id is the user request id; with n > 1 child ``i`` is ``f"{i}_{user_id}"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any

from frontend_service.detokenizer import (
    OutputText,
    StopStringMatcher,
    TokenTextDecoder,
    make_detokenizer,
)
from frontend_service.outputs import (
    CompletionOutput,
    FinishReasonName,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    RequestUsage,
    SampleLogprobs,
)
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    TokenColumns,
)
from tandem.protocol.sampling_params import (
    InvalidRequestError,
    RequestOutputKind,
    SamplingParams,
    int64_seed,
)

if TYPE_CHECKING:
    from frontend_service.input_processor import ProcessedRequest

_FINISH_NAMES: dict[FinishReason, FinishReasonName] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


class LogprobsState:
    """Sample and prompt logprobs of one engine request, with decoded tokens.

    Invariant: when sample logprobs were requested, ``logprobs`` has one entry per
    output token the request has kept.
    """

    def __init__(
        self,
        decoder: TokenTextDecoder | None,
        num_logprobs: int | None,
        num_prompt_logprobs: int | None,
    ) -> None:
        self._decoder = decoder
        self.logprobs: SampleLogprobs | None = [] if num_logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if num_logprobs is not None else None
        self._wants_prompt_logprobs = num_prompt_logprobs is not None
        self.prompt_logprobs: PromptLogprobs | None = None

    def _row(self, packed: Logprobs, row: int) -> dict[int, Logprob]:
        token_ids = packed.token_ids[row]
        values = packed.logprobs[row]
        texts: list[str | None] = (
            list(self._decoder.decode_each(token_ids))
            if self._decoder is not None
            else [None] * len(token_ids)
        )
        # Column 0 is the chosen token with its true rank; column j >= 1 has rank j.
        entries = {token_ids[0]: Logprob(values[0], packed.ranks[row], texts[0])}
        for column in range(1, len(token_ids)):
            entries.setdefault(token_ids[column], Logprob(values[column], column, texts[column]))
        return entries

    def add_sample(self, packed: Logprobs | None, row: int) -> None:
        """Record the logprobs of one new output token (row ``row`` of this step's rows)."""
        if self.logprobs is None:
            return
        if packed is None or row >= len(packed):
            self.logprobs.append({})  # the engine sent none: keep alignment with token ids
            return
        self.logprobs.append(self._row(packed, row))
        self.cumulative_logprob = (self.cumulative_logprob or 0.0) + packed.logprobs[row][0]

    def add_prompt(self, packed: Logprobs) -> None:
        """Record prompt logprobs; row i is prompt position i + 1."""
        if not self._wants_prompt_logprobs:
            return
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        self.prompt_logprobs.extend(self._row(packed, row) for row in range(len(packed)))


class RequestState:
    """Everything the frontend tracks for one engine request.

    Invariants: ``token_ids`` are the output tokens kept (tokens after a matched stop
    string are dropped); ``_sent_tokens``/``_sent_chars`` mark what DELTA outputs have
    already delivered; once ``finish_reason`` is set nothing changes any more.
    """

    def __init__(
        self,
        request: EngineCoreRequest,
        index: int,
        tokenizer: Any | None,
        decoder: TokenTextDecoder | None,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.index = index
        self._include_stop_str = params.include_stop_str_in_output
        # Tokens the engine stops on (their text is hidden); a request can also stop on
        # content, when its structured-output constraint completes.
        self._stop_token_ids = set(params.stop_token_ids)
        if request.eos_token_id is not None and not params.ignore_eos:
            self._stop_token_ids.add(request.eos_token_id)
        self.token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.finish_reason: FinishReasonName | None = None
        self.stop_reason: int | str | None = None
        self.logprobs = LogprobsState(decoder, params.logprobs, params.prompt_logprobs)
        self.text: OutputText | None = None
        if tokenizer is not None and params.detokenize:
            self.text = OutputText(
                make_detokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens),
                StopStringMatcher(params.stop, params.include_stop_str_in_output),
                params.min_tokens,
            )
        self._sent_tokens = 0
        self._sent_chars = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> bool:
        """Apply one engine step's output; True if a stop string finished the request
        while the engine still runs it (so the engine must abort it).

        The engine's own stop token (EOS or a stop token id) stays in ``token_ids``,
        but its text is not shown unless ``include_stop_str_in_output``.
        """
        if self.finished:
            return False
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.new_prompt_logprobs is not None:
            self.logprobs.add_prompt(output.new_prompt_logprobs)
        new_ids = output.new_token_ids
        hide_last = (
            output.finish_reason == FinishReason.STOP
            and not self._include_stop_str
            and bool(new_ids)
            and new_ids[-1] in self._stop_token_ids
        )
        if self._add_tokens(new_ids, output.new_logprobs, hide_last):
            return output.finish_reason is None
        if output.finish_reason is not None:
            self.finish(_FINISH_NAMES[output.finish_reason], output.stop_reason)
        return False

    def add_tokens(self, new_ids: list[int], num_cached_tokens: int) -> bool:
        """Apply a step's output that carries only new tokens (a TokenColumns entry:
        the engine did not finish the request); True as for ``update``."""
        if self.finished:
            return False
        if num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = num_cached_tokens
        return self._add_tokens(new_ids, None, False)

    def _add_tokens(self, new_ids: list[int], logprobs: Logprobs | None, hide_last: bool) -> bool:
        """Append the tokens (and their text); True if a stop string finished the request
        (the rest of ``new_ids`` is then dropped). ``hide_last``: the last token is the
        engine's stop token, kept in ``token_ids`` but not shown."""
        for position, token_id in enumerate(new_ids):
            self.token_ids.append(token_id)
            self.logprobs.add_sample(logprobs, position)
            if self.text is None or (hide_last and position == len(new_ids) - 1):
                continue
            match = self.text.add_token(token_id)
            if match is not None:
                self._finish("stop", match.stop)
                return True
        return False

    def finish(self, reason: FinishReasonName, stop_reason: int | str | None = None) -> None:
        """End the request; a stop string in the remaining held-back text takes precedence."""
        if self.finished:
            return
        if self.text is not None:
            match = self.text.finish()
            if match is not None:
                reason, stop_reason = "stop", match.stop
        self._finish(reason, stop_reason)

    def _finish(self, reason: FinishReasonName, stop_reason: int | str | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _shown_length(self) -> int:
        return 0 if self.text is None else self.text.shown_length(self.finished)

    def _text_slice(self, start: int, end: int) -> str:
        return "" if self.text is None else self.text.text[start:end]

    def cumulative(self) -> CompletionOutput:
        """Everything so far (text minus what a stop string may still take back)."""
        return CompletionOutput(
            index=self.index,
            text=self._text_slice(0, self._shown_length()),
            token_ids=list(self.token_ids),
            cumulative_logprob=self.logprobs.cumulative_logprob,
            logprobs=list(self.logprobs.logprobs) if self.logprobs.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def delta(self) -> CompletionOutput:
        """What is new since the previous ``delta``; marks it delivered."""
        shown = self._shown_length()
        sample_logprobs = self.logprobs.logprobs
        completion = CompletionOutput(
            index=self.index,
            text=self._text_slice(self._sent_chars, shown),
            token_ids=self.token_ids[self._sent_tokens :],
            cumulative_logprob=self.logprobs.cumulative_logprob,
            logprobs=sample_logprobs[self._sent_tokens :] if sample_logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self._sent_chars = max(self._sent_chars, shown)
        self._sent_tokens = len(self.token_ids)
        return completion


class ParentRequest:
    """One user request: fans out into ``n`` engine requests and gathers their outputs.

    Child ``i`` gets ``n = 1`` and, when the user gave a seed, ``seed + i`` (wrapped into
    int64, the wire's type: the same random stream, which is a function of the seed mod
    2**64), so the n samples differ from each other yet the whole request is reproducible.

    Aggregation by output kind:

    * DELTA: each ``RequestOutput`` holds the deltas of the children that progressed;
    * CUMULATIVE: each holds all ``n`` children so far (empty ones included);
    * FINAL_ONLY: a single output once every child has finished.

    Usage counts the prompt once, completion tokens summed over children, and the
    largest prefix-cache hit among children.

    ``stream_interval`` (vLLM's ``--stream-interval``): DELTA and CUMULATIVE outputs come
    at the first token, then once at least that many tokens (all children) are new since
    the previous output, and at the finish; 1: every step that made progress.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        if not isinstance(sampling_params.n, int) or sampling_params.n < 1:
            raise InvalidRequestError("n", sampling_params.n, "must be an integer >= 1")
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self._children: list[RequestState | None] = [None] * self.n
        self._prompt_logprobs_sent = False
        self._final_sent = False
        self._aborted = False
        self._num_outputs = 0  # RequestOutputs made so far
        self._tokens_at_output = 0  # output tokens of all children at the last one
        # Children that progressed in steps held back by the stream interval: their
        # deltas go out with the next output.
        self._held: list[RequestState] = []

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.sampling_params.output_kind

    def child_request_id(self, index: int) -> str:
        self._check_index(index)
        return self.request_id if self.n == 1 else f"{index}_{self.request_id}"

    def child_sampling_params(self, index: int) -> SamplingParams:
        self._check_index(index)
        seed = self.sampling_params.seed
        return dataclasses.replace(
            self.sampling_params,
            n=1,
            seed=None if seed is None else int64_seed(seed + index),
            stop=list(self.sampling_params.stop),
            stop_token_ids=list(self.sampling_params.stop_token_ids),
        )

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.n:
            raise IndexError(f"child index {index} outside [0, {self.n})")

    def attach(self, state: RequestState) -> None:
        self._check_index(state.index)
        if self._children[state.index] is not None:
            raise ValueError(f"child {state.index} of {self.request_id!r} already attached")
        self._children[state.index] = state

    @property
    def children(self) -> list[RequestState]:
        return [c for c in self._children if c is not None]

    @property
    def finished(self) -> bool:
        if self.n == 1:  # the common case, asked twice per request and step
            child = self._children[0]
            return self._aborted or (child is not None and child.finished)
        return self._aborted or all(c is not None and c.finished for c in self._children)

    def abort(self) -> list[RequestState]:
        """Finish every unfinished child with "abort"; return those children."""
        aborted = [c for c in self.children if not c.finished]
        for child in aborted:
            child.finish("abort")
        self._aborted = True
        return aborted

    def make_output(self, progressed: Sequence[RequestState], stream_interval: int = 1) -> RequestOutput | None:
        """The ``RequestOutput`` after this step, or None when nothing is due.
        ``progressed``: the children that moved this step (one may appear twice)."""
        if self._final_sent:
            return None
        finished = self.finished
        kind = self.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        children = self.children
        num_tokens = sum(len(c.token_ids) for c in children) if stream_interval > 1 else 0
        if stream_interval > 1:
            if not finished and self._num_outputs and num_tokens - self._tokens_at_output < stream_interval:
                self._held.extend(progressed)
                return None
            if self._held:
                progressed = [*self._held, *progressed]
                self._held = []
        self._num_outputs += 1
        self._tokens_at_output = num_tokens
        if kind != RequestOutputKind.DELTA:
            completions = [self._cumulative(i) for i in range(self.n)]
        elif self.n == 1:  # every entry of progressed is the one child
            completions = [progressed[0].delta()] if progressed else []
        else:
            unique = {s.index: s for s in progressed}
            completions = [unique[i].delta() for i in sorted(unique)]
        self._final_sent = finished
        cached = max([c.num_cached_tokens for c in children], default=0)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=self._prompt_logprobs(children),
            num_cached_tokens=cached,
            usage=RequestUsage(
                prompt_tokens=len(self.prompt_token_ids),
                completion_tokens=sum(len(c.token_ids) for c in children),
                cached_tokens=cached,
            ),
        )

    def _cumulative(self, index: int) -> CompletionOutput:
        child = self._children[index]
        if child is None:
            return CompletionOutput(index=index, text="", token_ids=[])
        return child.cumulative()

    def _prompt_logprobs(self, children: list[RequestState]) -> PromptLogprobs | None:
        """The first child's prompt logprobs; DELTA sends them only once."""
        for child in children:
            found = child.logprobs.prompt_logprobs
            if found is None:
                continue
            if self.output_kind == RequestOutputKind.DELTA:
                if self._prompt_logprobs_sent:
                    return None
                self._prompt_logprobs_sent = True
            return found
        return None


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
