"""Structured output (JSON schema, regex, choice, grammar) on the engine side; see
``manager.py`` for how it hooks into the step."""

from engine_service.structured_output.manager import (
    Advance,
    MaskFill,
    StructuredOutputManager,
    StructuredRequest,
)

__all__ = ["Advance", "MaskFill", "StructuredOutputManager", "StructuredRequest"]
