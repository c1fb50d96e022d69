"""Model code: checkpoint config, our own decoder implementation and the weight loader."""

from engine_service.models.decoder import DecoderForCausalLM
from engine_service.models.loader import load_model
from tandem.protocol.model_config import ModelConfig, ModelLoadError

__all__ = ["DecoderForCausalLM", "ModelConfig", "ModelLoadError", "load_model"]
