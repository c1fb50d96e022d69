"""Structured-output constraints of one request (vLLM's ``StructuredOutputsParams``).

Torch-free and library-free: the frontend checks the shape of a constraint (exactly one
kind, right types); the engine compiles it (``engine_service/structured_output/``) and
reports a constraint that does not compile as INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.protocol.sampling_params import InvalidRequestError

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
