"""LoRA on an EngineCore: vLLM's adapter utility calls and per-request resolution.

``LoRAUtilities`` is the engine's one object for them, over its ``LoRAManager`` (None
without --enable-lora: every call then raises InvalidRequestError). ``preload_loras``
registers ``--lora-modules`` at start-up, before the scheduler exists.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_service.config import ConfigError
from engine_service.lora.manager import LoRAManager
from tandem.protocol.lora import LoRARequest
from tandem.protocol.sampling_params import InvalidRequestError

_NOT_ENABLED = "LoRA is not enabled on this engine (start it with --enable-lora)"


def preload_loras(manager: LoRAManager, modules: list[str]) -> None:
    """``--lora-modules NAME=PATH ...``: registered with ids 1, 2, ... in order."""
    for adapter_id, item in enumerate(modules, start=1):
        name, _, path = item.partition("=")
        try:
            manager.add_lora(LoRARequest(name, adapter_id, path))
        except InvalidRequestError as exc:
            raise ConfigError(f"lora_modules {item!r}: {exc}") from exc


class LoRAUtilities:
    """The adapter calls of one engine. Runs on the engine thread (reading an adapter
    touches the manager's caches)."""

    def __init__(self, manager: LoRAManager | None, running_lora_ids: Callable[[], set[int]]) -> None:
        """``manager``: None without --enable-lora. ``running_lora_ids``: the adapter ids of
        the running requests (the scheduler's), which pinning must not evict."""
        self.manager = manager
        self._running_lora_ids = running_lora_ids

    def resolve(self, lora: LoRARequest) -> LoRARequest:
        """A request's adapter: a by-name request resolved, a new adapter registered and
        checked to load. Only called for a request that validation let through (so LoRA
        is enabled)."""
        manager = self._require("lora_request")
        lora = manager.resolve(lora)
        manager.add_lora(lora)
        return lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter for later requests; True if it was new."""
        return self._require("lora_request").add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._require("lora_id").remove_lora(lora_id)

    def list_loras(self) -> list[int]:
        return self._require("lora_id").list_loras()

    def lora_requests(self) -> list[LoRARequest]:
        """Every registered adapter, by id (what frontends learn names from)."""
        manager = self._require("lora_id")
        return [manager.known[i] for i in manager.list_loras()]

    def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter in a device slot (never evicted)."""
        return self._require("lora_id").pin_lora(lora_id, self._running_lora_ids())

    def _require(self, field: str) -> LoRAManager:
        if self.manager is None:
            raise InvalidRequestError(field, None, _NOT_ENABLED)
        return self.manager
