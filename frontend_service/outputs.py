"""What the frontend hands to its callers: vLLM-shaped request results, with text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReasonName = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class Logprob:
    """One candidate token at one position."""

    logprob: float
    rank: int | None = None  # 1 = most likely; None when unknown
    decoded_token: str | None = None  # the token decoded on its own; None without a tokenizer


# Position i maps token id -> Logprob; the chosen token is always present.
SampleLogprobs = list[dict[int, Logprob]]
# Position i is prompt token i; position 0 is None (the first token has no logprob).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # None unless logprobs were requested
    logprobs: SampleLogprobs | None = None  # None unless logprobs were requested
    finish_reason: FinishReasonName | None = None  # None while still generating
    stop_reason: int | str | None = None  # stop token id, stop string, or None (EOS, length)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestUsage:
    """Token counts of a whole request; completion tokens sum over its n sequences."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestOutput:
    """The state of one user request, as streamed to the caller.

    With DELTA output each ``CompletionOutput`` carries only what is new since the
    previous ``RequestOutput`` of this request; otherwise everything so far.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # sorted by index
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    usage: RequestUsage = field(default_factory=RequestUsage)


def merge_request_outputs(earlier: RequestOutput, later: RequestOutput, delta: bool) -> RequestOutput:
    """One ``RequestOutput`` that says what ``earlier`` then ``later`` said.

    For a reader that fell behind: its queued outputs go out as one message. With DELTA
    output the completions' new text, token ids and logprobs are concatenated per index
    (finish state, usage and cumulative logprob from ``later``); otherwise each output
    already holds everything so far and ``later`` stands for both.
    """
    if not delta:
        return later
    by_index = {c.index: c for c in earlier.outputs}
    for c in later.outputs:
        before = by_index.get(c.index)
        if before is None:
            by_index[c.index] = c
            continue
        logprobs = c.logprobs
        if before.logprobs is not None and c.logprobs is not None:
            logprobs = before.logprobs + c.logprobs
        by_index[c.index] = CompletionOutput(
            index=c.index,
            text=before.text + c.text,
            token_ids=[*before.token_ids, *c.token_ids],
            cumulative_logprob=c.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
    return RequestOutput(
        request_id=later.request_id,
        prompt=earlier.prompt,
        prompt_token_ids=earlier.prompt_token_ids,
        outputs=[by_index[i] for i in sorted(by_index)],
        finished=later.finished,
        prompt_logprobs=earlier.prompt_logprobs if earlier.prompt_logprobs is not None else later.prompt_logprobs,
        num_cached_tokens=later.num_cached_tokens,
        usage=later.usage,
    )


@dataclass
class PoolingOutput:
    """A pooling request's vector (vLLM's PoolingOutput / EmbeddingOutput)."""

    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data


@dataclass
class PoolingRequestOutput:
    """The result of one pooling (embedding) request: it finishes in one output."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
