"""One user request over its ``n`` engine requests: ``ParentRequest``.

It fans the user's sampling params out into per-child params (ids and seeds) and gathers
the children's ``RequestState``s (request_state.py) into ``RequestOutput``s by output
kind. The input processor makes one per user request; the output processor feeds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from frontend_service.outputs import CompletionOutput, PromptLogprobs, RequestOutput, RequestUsage
from frontend_service.request_state import RequestState
from tandem.protocol.sampling_params import (
    InvalidRequestError,
    RequestOutputKind,
    SamplingParams,
    int64_seed,
)


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
        # Output tokens of all children at the last RequestOutput (None: none made yet);
        # kept with a stream interval only.
        self._tokens_at_output: int | None = None
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
        if stream_interval > 1:
            num_tokens = sum(len(c.token_ids) for c in children)
            sent = self._tokens_at_output
            if not finished and sent is not None and num_tokens - sent < stream_interval:
                self._held.extend(progressed)
                return None
            self._tokens_at_output = num_tokens
            if self._held:
                progressed = [*self._held, *progressed]
                self._held = []
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
