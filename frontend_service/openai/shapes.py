"""OpenAI response pieces as plain dicts: logprobs, usage, finish reasons, SSE framing.

Built by hand rather than through pydantic models: a streamed token costs one small dict
and one ``json.dumps``. Shapes (OpenAI's):

- completions logprobs: ``{"tokens": [str], "token_logprobs": [float|None],
  "top_logprobs": [{str: float}|None], "text_offset": [int]}``, one entry per token;
- chat logprobs: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}]}]}``;
- usage: ``{"prompt_tokens", "completion_tokens", "total_tokens"[, "prompt_tokens_details":
  {"cached_tokens"}]}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from frontend_service.outputs import Logprob, RequestUsage

DONE = b"data: [DONE]\n\n"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def dumps(obj: Any) -> str:
    """Compact JSON (no spaces, UTF-8 kept as is)."""
    return _dumps(obj)


def sse(payload: str) -> bytes:
    """One server-sent event carrying ``payload`` (a JSON text)."""
    return f"data: {payload}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def add_usage(total: RequestUsage, part: RequestUsage) -> None:
    total.prompt_tokens += part.prompt_tokens
    total.completion_tokens += part.completion_tokens
    total.cached_tokens += part.cached_tokens


def finish_reason(reason: str | None) -> str | None:
    """The domain's finish reason as OpenAI names it ("error" never gets here: it fails
    the request). "abort" (an operator's pause or abort) is passed on as vLLM does."""
    return reason


def _token_text(lp: Logprob | None, token_id: int, tokenizer: Any) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


class CompletionLogprobs:
    """Completions-shaped logprobs of one choice; keeps the running ``text_offset``."""

    __slots__ = ("num", "offset", "tokenizer")

    def __init__(self, num: int, tokenizer: Any, offset: int = 0) -> None:
        self.num = num  # top-N per position (the sampled token is always listed too)
        self.tokenizer = tokenizer
        self.offset = offset  # characters of this choice's text before the next token

    def build(
        self,
        token_ids: Sequence[int],
        positions: Sequence[dict[int, Logprob] | None],
    ) -> dict[str, Any]:
        """Logprobs of ``token_ids``; ``positions[i]`` holds token i's candidates (None:
        the prompt's first token, which has no logprob)."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token, entries in zip(token_ids, positions):
            chosen = entries.get(token) if entries is not None else None
            text = _token_text(chosen, token, self.tokenizer)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entries is None or chosen is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(chosen.logprob)
            top = {
                _token_text(lp, tid, self.tokenizer): lp.logprob
                for tid, lp in entries.items()
                if lp.rank is not None and lp.rank <= self.num
            }
            top.setdefault(text, chosen.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[dict[int, Logprob]], num: int, tokenizer: Any
) -> dict[str, Any]:
    """Chat-shaped logprobs: ``num`` most likely alternatives per token, by rank."""
    content = []
    for token, entries in zip(token_ids, positions):
        chosen = entries.get(token)
        text = _token_text(chosen, token, tokenizer)
        entry = _chat_entry(text, chosen.logprob if chosen is not None else float("-inf"))
        ranked = sorted(
            ((lp.rank, tid, lp) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= num),
            key=lambda item: item[0],
        )
        entry["top_logprobs"] = [
            _chat_entry(_token_text(lp, tid, tokenizer), lp.logprob) for _, tid, lp in ranked
        ]
        content.append(entry)
    return {"content": content}
