"""What the frontend tracks of one engine request: its kept tokens, their text
(incremental detokenization and stop strings), its logprobs, and what DELTA outputs have
delivered so far (``RequestState``, with ``LogprobsState``)."""

from __future__ import annotations

from typing import Any

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
    SampleLogprobs,
)
from tandem.protocol.outputs import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs

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
