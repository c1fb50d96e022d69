"""``--speculative-config``: vLLM's JSON shape, read into one documented dataclass.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    --speculative-config '{"method": "suffix", "num_speculative_tokens": 8}'
    --speculative-config '{"model": "path/to/small-model", "num_speculative_tokens": 4}'

Keys are vLLM's names; a key Tandem does not read is refused by name rather than ignored.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")


class SpeculativeConfigError(ValueError):
    """``--speculative-config`` is not JSON, names an unknown key, or holds a bad value."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and when speculation steps aside."""

    method: str  # "ngram" (prompt lookup), "suffix" (suffix decoding) or "draft_model"
    num_speculative_tokens: int  # k: most draft tokens verified per request and step
    # draft_model: the draft's checkpoint (a directory or a GGUF file, with the target's
    # vocabulary) and how its weights load (the engine's --quantization values).
    model: str = ""
    quantization: str = "auto"
    # ngram: the longest n-gram in [min, max] that ends the sequence and occurred before.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # suffix: the suffix trie's depth, the least probability of a drafted path, and how many
    # finished requests' outputs the shared trie keeps (0: each request's own trie only).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 1000
    # Load awareness: no drafts in a step that runs more requests than this (0: never off).
    disable_by_batch_size: int = 16
    # What one draft token adds to a decode step's time, as a fraction of it (0: measured at
    # start-up on the engine's model and device, step_costs.py). Each request drafts the k (<= num_speculative_tokens)
    # that maximizes its expected tokens per step time, (1 - a^(k+1)) / (1 - a) / (1 + cost k),
    # for its running acceptance rate a; none where no k beats a plain step. A request that
    # stopped drafting tries one draft token every ``probe_interval`` steps.
    draft_token_cost: float = 0.0
    probe_interval: int = 16
    # draft_model: what one draft token's forward of the draft model costs, as a fraction of
    # a target decode step (0: measured at start-up, batch 1); it adds to draft_token_cost.
    draft_model_cost: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if (self.method == "draft_model") != bool(self.model):
            raise SpeculativeConfigError(
                "speculative_config: a draft model needs method 'draft_model' and its 'model' path"
                if self.model else "speculative_config: method 'draft_model' needs 'model', the draft's checkpoint"
            )
        if self.quantization not in ("auto", "none", "int8"):
            raise SpeculativeConfigError(
                f"speculative_config quantization must be auto, none or int8, got {self.quantization!r}"
            )
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        _positive("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth)
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise SpeculativeConfigError(
                f"suffix_decoding_min_token_prob must be in [0, 1], got {self.suffix_decoding_min_token_prob}"
            )
        _positive("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, allow_zero=True)
        _positive("disable_by_batch_size", self.disable_by_batch_size, allow_zero=True)
        if not 0.0 <= self.draft_token_cost <= 10.0:
            raise SpeculativeConfigError(f"draft_token_cost must be in [0, 10], got {self.draft_token_cost}")
        _positive("probe_interval", self.probe_interval)
        if not 0.0 <= self.draft_model_cost <= 10.0:
            raise SpeculativeConfigError(f"draft_model_cost must be in [0, 10], got {self.draft_model_cost}")

    @classmethod
    def parse(cls, text: str | dict[str, Any]) -> SpeculativeConfig:
        """From ``--speculative-config``'s JSON object (or the dict it holds)."""
        if isinstance(text, str):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError(f"speculative_config is not JSON: {exc}") from exc
        else:
            data = text
        if not isinstance(data, dict):
            raise SpeculativeConfigError(f"speculative_config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config: unknown or unsupported key(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        if "model" in data and "method" not in data:  # vLLM's shorthand for a draft model
            data = {**data, "method": "draft_model"}
        for name in ("method", "num_speculative_tokens"):
            if name not in data:
                raise SpeculativeConfigError(f"speculative_config needs {name!r}")
        for f in fields(cls):
            if f.name in data and f.type in ("int", "float") and isinstance(data[f.name], bool):
                raise SpeculativeConfigError(f"speculative_config {f.name} must be a number, got {data[f.name]!r}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive(name: str, value: object, allow_zero: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise SpeculativeConfigError(f"{name} must be a {kind} integer, got {value!r}")
