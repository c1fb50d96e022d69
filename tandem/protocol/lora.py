"""``LoRARequest``: which LoRA adapter a request runs with, as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.protocol.sampling_params import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT-format LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``lora_int_id`` (> 0) identifies the adapter inside an engine: two requests with the
    same id share one loaded copy and one device slot. Over gRPC a request may name an
    adapter the engine already knows by ``lora_name`` alone (``lora_int_id`` 0, no path).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    def validate(self, field: str = "lora_request") -> None:
        """Raise InvalidRequestError naming ``field.<attribute>`` on a malformed request."""
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(f"{field}.lora_name", self.lora_name, "must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 0:
            raise InvalidRequestError(
                f"{field}.lora_int_id", self.lora_int_id, "must be a positive integer (0: look up by name)"
            )
        if not isinstance(self.lora_path, str):
            raise InvalidRequestError(f"{field}.lora_path", self.lora_path, "must be a string")
        if self.lora_int_id > 0 and not self.lora_path:
            raise InvalidRequestError(f"{field}.lora_path", self.lora_path, "is required with a lora_int_id")

    @property
    def cache_key(self) -> str:
        """What prefix-cache hashes mix in: requests of different adapters never share KV."""
        return f"{self.lora_int_id}\x00{self.lora_name}\x00{self.lora_path}"
