"""Sampling parameters of one request, its structured-output constraint, and their validation.

``InvalidRequestError`` is the error of every request field (this package's other
modules raise it too). ``StructuredOutputsParams`` lives here, beside the
``SamplingParams`` that holds one, because both raise that error and the holder checks
the constraint's type: one module, no import circle. ``tandem.protocol.structured_output``
is its public name for importers.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any


class InvalidRequestError(ValueError):
    """A request field has a bad value. Maps to gRPC INVALID_ARGUMENT.

    ``field`` names the offending field so a client sees exactly what to fix.
    """

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid {field}={shown}: {reason}")


MAX_STOP_STRINGS = 128  # every stop string is searched for on every new token
# torch.Generator.manual_seed accepts [-2**63, 2**64); the wire's int64 fits inside.
# Seeded sampling uses the seed mod 2**64, so a seed and the int64 with its low 64 bits
# (``int64_seed``) draw the same tokens.
SEED_RANGE = (-(2**63), 2**64)


def int64_seed(seed: int) -> int:
    """The int64 (the wire's type) that samples as ``seed`` does: equal mod 2**64."""
    return (seed + 2**63) % 2**64 - 2**63


class RequestOutputKind(enum.IntEnum):
    """What each streamed output of a request carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; field names and meanings follow vLLM."""

    n: int = 1
    # 0 (below 1e-5) means greedy; any finite value is valid: a huge one (1e300) samples
    # uniformly among the tokens left (the engine computes in float32, saturating).
    temperature: float = 1.0
    top_p: float = 1.0  # in (0, 1]
    top_k: int | None = None  # None or -1: disabled; else >= 1
    min_p: float = 0.0  # in [0, 1]
    seed: int | None = None  # per-request generator: same tokens whatever the batch
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    # > 0; applies to prompt and output tokens; acts within [1e-30, 1e30] (past that a
    # seen token's logit saturates anyway).
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added logit (saturates at +-1e30)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop tokens are masked until this many are out
    stop: list[str] = field(default_factory=list)  # stop strings (frontend-side)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text (and no stop strings)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # JSON schema / regex / choice / grammar the output must match (None: free text).
    structured_outputs: StructuredOutputsParams | None = None
    # False: no speculative drafts for this request (where the engine speculates).
    speculative: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k is not None and self.top_k != -1

    def validate(self, vocab_size: int | None = None, max_logprobs: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        _int_at_least("n", self.n, 1)
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", self.temperature, "must be >= 0")
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k is not None and self.top_k != -1:
            _int_at_least("top_k", self.top_k, 1, extra="or -1 to disable")
        _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, value, "must be in [-2, 2]")
        _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty", self.repetition_penalty, "must be > 0")
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise InvalidRequestError(
                "seed", self.seed, f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _int_at_least(name, value, 0)
            if max_logprobs is not None and value > max_logprobs:
                raise InvalidRequestError(
                    name, value, f"must be <= the engine's max_logprobs ({max_logprobs})"
                )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                "stop", f"<{len(self.stop)} strings>", f"at most {MAX_STOP_STRINGS} stop strings"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", self.stop, "stop strings must be non-empty")
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop", self.stop, "stop strings need text: not with detokenize=false")
        if vocab_size is not None:
            _token_ids_in_vocab("stop_token_ids", self.stop_token_ids, vocab_size)
            if self.allowed_token_ids is not None:
                if not self.allowed_token_ids:
                    raise InvalidRequestError(
                        "allowed_token_ids", self.allowed_token_ids, "must not be empty"
                    )
                _token_ids_in_vocab("allowed_token_ids", self.allowed_token_ids, vocab_size)
            if self.logit_bias:
                _token_ids_in_vocab("logit_bias", list(self.logit_bias), vocab_size)
                for token, bias in self.logit_bias.items():
                    _finite(f"logit_bias[{token}]", bias)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidRequestError("output_kind", self.output_kind, "unknown output kind")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError(
                    "structured_outputs", self.structured_outputs, "must be StructuredOutputsParams"
                )
            self.structured_outputs.validate()


def _finite(name: str, value: Any) -> None:
    if not isinstance(value, int | float) or value != value or value in (
        float("inf"),
        float("-inf"),
    ):
        raise InvalidRequestError(name, value, "must be a finite number")


def _int_at_least(name: str, value: Any, low: int, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        suffix = f" {extra}" if extra else ""
        raise InvalidRequestError(name, value, f"must be an integer >= {low}{suffix}")


def _token_ids_in_vocab(name: str, ids: list[int], vocab_size: int) -> None:
    if len(ids) > vocab_size:  # more ids than the vocabulary has can only repeat some
        raise InvalidRequestError(
            name, f"<{len(ids)} ids>", f"at most vocab_size ({vocab_size}) token ids"
        )
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError(name, token, f"token id outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's own sampling settings (its ``generation_config.json``), used for every field a
    request leaves unset, as vLLM does with ``--generation-config auto``. None: the field's
    usual default (temperature 1.0, top_p 1.0, no top_k, min_p 0, repetition_penalty 1.0)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

    @classmethod
    def from_model_dir(cls, model_dir: str) -> SamplingDefaults:
        """The settings in ``model_dir/generation_config.json`` (none if it has no such file)."""
        import os

        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.isfile(path):
            return cls()
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        values = {name: raw.get(name) for name in cls.FIELDS}
        if values["top_k"] is not None and values["top_k"] <= 0:
            values["top_k"] = None  # transformers' 0 / -1: no top-k
        return cls(**{k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)})

    def pick(self, name: str, value: Any, fallback: Any) -> Any:
        """``value`` if the request set it (not None), else this model's setting, else ``fallback``."""
        if value is not None:
            return value
        own = getattr(self, name)
        return fallback if own is None else own

    def as_dict(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in self.FIELDS if getattr(self, name) is not None}


# ---- structured outputs ------------------------------------------------------------------

# The kinds, in the order vLLM documents them; each is a field of StructuredOutputsParams.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_CONSTRAINT_CHARS = 1 << 20  # a constraint's text (schema, regex, grammar) at most 1 MiB
MAX_CHOICES = 4096


@dataclass
class StructuredOutputsParams:
    """At most one constraint kind is set.

    ``json``: a JSON schema, as text or as a parsed object; ``regex``: the output
    matches it in full; ``choice``: the output is one of these strings; ``grammar``: an
    EBNF / GBNF (or Lark) grammar; ``json_object``: any JSON object;
    ``structural_tag``: vLLM's structural-tag JSON (free text with tagged, schema-bound
    regions).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # JSON output without whitespace between its tokens (vLLM's name).
    disable_any_whitespace: bool = False

    @property
    def kind(self) -> str:
        """The one kind that is set (validate() first)."""
        for name in KINDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                return name
        raise InvalidRequestError("structured_outputs", None, "no constraint is set")

    @property
    def field_name(self) -> str:
        """The field a client names to fix this constraint."""
        return f"structured_outputs.{self.kind}"

    def spec(self) -> str:
        """The constraint's text: what is compiled, and (with the kind) the cache key."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        if kind == "choice":
            return json.dumps(value)
        if kind == "json_object":
            return ""
        return value

    @property
    def key(self) -> tuple[str, str, bool]:
        """Cache key of the compiled constraint."""
        return (self.kind, self.spec(), self.disable_any_whitespace)

    def validate(self) -> None:
        """Raise InvalidRequestError naming the field: exactly one kind, right types."""
        set_kinds = [
            name for name in KINDS if getattr(self, name) is not None and getattr(self, name) is not False
        ]
        if len(set_kinds) != 1:
            shown = ", ".join(set_kinds) or "none"
            raise InvalidRequestError(
                "structured_outputs", shown, f"set exactly one of {', '.join(KINDS)}"
            )
        kind = set_kinds[0]
        field = f"structured_outputs.{kind}"
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as exc:
                    raise InvalidRequestError(field, value, f"not valid JSON: {exc}") from None
            else:
                parsed = value
            if not isinstance(parsed, dict | bool):
                raise InvalidRequestError(field, value, "a JSON schema is an object (or a boolean)")
        elif kind == "json_object":
            if value is not True:
                raise InvalidRequestError(field, value, "must be true when set")
        elif kind == "choice":
            if not isinstance(value, list) or not value:
                raise InvalidRequestError(field, value, "must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise InvalidRequestError(field, f"<{len(value)} choices>", f"at most {MAX_CHOICES}")
            if any(not isinstance(c, str) or not c for c in value):
                raise InvalidRequestError(field, value, "every choice must be a non-empty string")
        elif not isinstance(value, str) or not value.strip():
            raise InvalidRequestError(field, value, "must be a non-empty string")
        if len(self.spec()) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(
                field, f"<{len(self.spec())} characters>", f"at most {MAX_CONSTRAINT_CHARS} characters"
            )
        if kind == "structural_tag":
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                raise InvalidRequestError(field, value, f"not valid JSON: {exc}") from None
            if not isinstance(parsed, dict):
                raise InvalidRequestError(field, value, "a structural tag is a JSON object")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError(
                "structured_outputs.disable_any_whitespace", self.disable_any_whitespace, "must be a boolean"
            )
