"""Tandem's frontend: text, clients and engines. ``LLM`` is the in-process offline API.

The frontend itself imports no torch; ``LLM`` runs an engine in-process, so it is
imported (with the engine and torch) only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.protocol.lora import LoRARequest
from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import RequestOutputKind, SamplingParams
from tandem.protocol.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from frontend_service.llm import LLM

__all__ = [
    "LLM",
    "LoRARequest",
    "PoolingParams",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from frontend_service.llm import LLM

        return LLM
    raise AttributeError(f"module 'frontend_service' has no attribute {name!r}")
