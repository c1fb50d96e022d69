"""Tandem's frontend: text, clients and engines. ``LLM`` is the in-process offline API."""

from engine_service.sampling_params import RequestOutputKind, SamplingParams
from frontend_service.llm import LLM

__all__ = ["LLM", "RequestOutputKind", "SamplingParams"]
