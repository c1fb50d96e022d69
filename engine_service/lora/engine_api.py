"""LoRA on an EngineCore: vLLM's adapter utility calls and per-request resolution."""

from __future__ import annotations

from typing import Any

from engine_service.config import ConfigError
from engine_service.lora.manager import LoRAManager
from tandem.protocol.lora import LoRARequest
from tandem.protocol.sampling_params import InvalidRequestError


class LoRAUtilities:
    """Mixed into EngineCore (its ``lora`` manager, None without --enable-lora, and scheduler)."""

    lora: LoRAManager | None
    scheduler: Any

    def _preload_loras(self, modules: list[str]) -> None:
        """``--lora-modules NAME=PATH ...``: registered with ids 1, 2, ... in order."""
        for adapter_id, item in enumerate(modules, start=1):
            name, _, path = item.partition("=")
            try:
                self.add_lora(LoRARequest(name, adapter_id, path))
            except InvalidRequestError as exc:
                raise ConfigError(f"lora_modules {item!r}: {exc}") from exc

    def _lora_for_request(self, lora: LoRARequest) -> LoRARequest:
        """Resolve a by-name request, register a new adapter, and check it loads (on the
        engine thread: reading an adapter touches the manager's caches)."""
        assert self.lora is not None
        lora = self.lora.resolve(lora)
        self.lora.add_lora(lora)
        return lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter for later requests; True if it was new."""
        return self._require_lora("lora_request").add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._require_lora("lora_id").remove_lora(lora_id)

    def list_loras(self) -> list[int]:
        return self._require_lora("lora_id").list_loras()

    def lora_requests(self) -> list[LoRARequest]:
        """Every registered adapter, by id (what frontends learn names from)."""
        lora = self._require_lora("lora_id")
        return [lora.known[i] for i in lora.list_loras()]

    def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter in a device slot (never evicted)."""
        running = {r.lora_int_id for r in self.scheduler.running}
        return self._require_lora("lora_id").pin_lora(lora_id, running)

    def _require_lora(self, field: str) -> LoRAManager:
        if self.lora is None:
            raise InvalidRequestError(field, None, "LoRA is not enabled on this engine (start it with --enable-lora)")
        return self.lora
