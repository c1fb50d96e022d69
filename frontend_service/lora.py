"""The frontend's view of LoRA adapters: fan-out of vLLM's adapter calls to every engine.

``add_lora`` / ``remove_lora`` / ``list_loras`` / ``pin_lora`` call the engines' utility
methods of the same names on every serving engine. The registry also remembers each
adapter by name (from its own calls, and from the engines' ``--lora-modules`` at
start-up), so the OpenAI API's ``model`` field can select one and ``/v1/models`` can
list them. Requests carry the adapter's full ``LoRARequest`` (name, id and path), and an
engine loads an adapter it has not seen from that path on first use, so an engine that
joins later serves adapters added before it joined (a pin made before it joined does
not reach it).
"""

from __future__ import annotations

import logging

from frontend_service.engine_group import EngineGroup
from tandem.protocol.lora import LoRARequest
from tandem.protocol.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)


class LoraRegistry:
    def __init__(self, engines: EngineGroup) -> None:
        self.engines = engines
        self.by_name: dict[str, LoRARequest] = {}  # adapters the frontend knows, by name

    async def refresh(self) -> None:
        """Learn the adapters the engines already hold (their ``--lora-modules``)."""
        for engine in self.engines.placeable():
            try:
                for req in await engine.call_utility("lora_requests"):
                    self.by_name.setdefault(req.lora_name, req)
            except Exception as exc:  # an engine without LoRA: nothing to learn
                logger.debug("engine %d lists no LoRA adapters: %s", engine.index, exc)

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def resolve(self, lora_request: LoRARequest) -> LoRARequest:
        """A by-name request (``lora_int_id`` 0) made whole from the registry, so that any
        engine can load the adapter; otherwise (or unknown here) as given."""
        if lora_request.lora_int_id == 0:
            return self.by_name.get(lora_request.lora_name, lora_request)
        return lora_request

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        lora_request.validate()
        if lora_request.lora_int_id == 0:
            raise InvalidRequestError("lora_request.lora_int_id", 0, "must be > 0 to add an adapter")
        added = any(await self.engines.call_utility("add_lora", lora_request, serving_only=True))
        self.by_name[lora_request.lora_name] = lora_request
        return added

    async def remove_lora(self, lora_id: int) -> bool:
        removed = any(await self.engines.call_utility("remove_lora", int(lora_id), serving_only=True))
        for name, req in list(self.by_name.items()):
            if req.lora_int_id == lora_id:
                del self.by_name[name]
        return removed

    async def list_loras(self) -> set[int]:
        return {int(i) for ids in await self.engines.call_utility("list_loras", serving_only=True) for i in ids}

    async def pin_lora(self, lora_id: int) -> bool:
        return all(await self.engines.call_utility("pin_lora", int(lora_id), serving_only=True))
