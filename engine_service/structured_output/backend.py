"""llguidance as the grammar backend: the vocabulary, and constraint -> matcher.

Why llguidance and not xgrammar (measured in ``benchmarks/structured_output.py
--compare-backends``, bench-135m's 49,152-token vocabulary; figures in
``benchmarks/NOTES.md``): compiling a JSON schema is much faster than with xgrammar
(llguidance builds its lexer lazily), the per-token mask costs the same or less, a
compiled constraint is a matcher
we deep-copy per request, matchers roll back, and the wheel has no dependencies (xgrammar
pulls torch, triton and apache-tvm-ffi).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tandem.protocol.sampling_params import InvalidRequestError
from tandem.protocol.structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)

# A constraint whose grammar is bigger than this is refused (llguidance's own limits
# bound the work per token; this bounds compile time and memory).
_MAX_GRAMMAR_SIZE = 2_000_000


def load_tokenizer(model_dir: str, vocab_size: int) -> Any:
    """llguidance's view of the checkpoint's tokenizer, padded to the model's vocab_size
    (ids past the tokenizer's are never allowed). A one-off cost per engine, not per
    request (its time: benchmarks/NOTES.md)."""
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; InvalidRequestError naming the field when
    it does not translate (bad JSON, a GBNF that does not convert)."""
    import llguidance

    kind, spec, field = params.kind, params.spec(), params.field_name
    options = {"whitespace_flexible": not params.disable_any_whitespace}
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llguidance.grammar_from("choice", spec)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec)
        if kind == "structural_tag":
            return _structural_tag_grammar(spec)
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidRequestError(field, spec, str(exc)) from None
    raise InvalidRequestError("structured_outputs", kind, "unknown constraint kind")


def compile_matcher(tokenizer: Any, params: StructuredOutputsParams) -> Any:
    """A fresh ``llguidance.LLMatcher`` at the start of the constraint. Raises
    InvalidRequestError naming the field when the constraint does not compile."""
    import llguidance

    grammar = grammar_text(params)
    if len(grammar) > _MAX_GRAMMAR_SIZE:
        raise InvalidRequestError(params.field_name, f"<{len(grammar)} bytes>", "grammar too large")
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(params.field_name, params.spec(), matcher.get_error())
    return matcher


def _structural_tag_grammar(spec: str) -> str:
    """vLLM's structural tag ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``
    as llguidance tags: free text where each begin string opens a schema-bound region."""
    import llguidance

    tag = json.loads(spec)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list):
        raise ValueError('a structural tag needs non-empty "structures" and a "triggers" list')
    tags = []
    for i, item in enumerate(structures):
        begin, end, schema = item.get("begin"), item.get("end"), item.get("schema")
        if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, dict):
            raise ValueError(f'structures[{i}] needs string "begin" and "end" and an object "schema"')
        trigger = next((t for t in triggers if isinstance(t, str) and t and begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures[{i}].begin {begin!r} starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    return llguidance.StructTag.to_grammar(tags)
