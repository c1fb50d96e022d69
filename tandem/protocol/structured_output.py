"""Structured-output constraints of one request (vLLM's ``StructuredOutputsParams``).

Torch-free and library-free: the frontend checks the shape of a constraint (exactly one
kind, right types); the engine compiles it (``engine_service/structured_output/``) and
reports a constraint that does not compile as INVALID_ARGUMENT naming the field.

The constraint is defined in ``tandem.protocol.sampling_params``, beside the
``SamplingParams`` that holds and validates it and the ``InvalidRequestError`` both
raise; this module is its name for importers and imports nothing else, so the two
modules form no import circle.
"""

from __future__ import annotations

from tandem.protocol.sampling_params import (
    KINDS,
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    StructuredOutputsParams,
)

__all__ = ["KINDS", "MAX_CHOICES", "MAX_CONSTRAINT_CHARS", "StructuredOutputsParams"]
