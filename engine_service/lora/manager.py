"""Which adapters an engine knows, holds in host memory, and holds in device slots.

- known: every adapter registered (``--lora-modules``, ``add_lora``, or first seen in a
  request), by id and by name;
- host cache: loaded and checked adapters, at most ``max_cpu_loras``, least recently
  used dropped first (a dropped one is read again from its path when next needed);
- device slots: ``max_loras`` of them. An adapter runs only from a slot. The scheduler
  admits a request only when its adapter has a slot or can get one: a free slot, or
  the least recently used slot that is neither pinned nor used by a running request.
  So the running batch never holds more distinct adapters than ``max_loras``.
- pinned adapters (``pin_lora``) keep their slot; at least one slot stays unpinned.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch

from engine_service.lora.adapter import TARGET_MODULES, LoRAAdapter, load_adapter
from engine_service.lora.layers import LoRABatch, LoRAState, rebind_model, wrap_model
from tandem.protocol.lora import LoRARequest
from tandem.protocol.model_config import ModelConfig
from tandem.protocol.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model_config = model_config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.state = LoRAState()
        self.layers = wrap_model(model, model_config, max_loras, max_lora_rank, self.state, dtype, device)
        self.known: dict[int, LoRARequest] = {}
        self.ids_by_name: dict[str, int] = {}
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slots: list[int | None] = [None] * max_loras  # slot -> adapter id
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.slot_lru: OrderedDict[int, None] = OrderedDict()  # ids in slots, LRU first
        self.pinned: set[int] = set()

    def release_base(self) -> None:
        """Drop the wrappers' base projections (the model's weights: sleep level 2); the
        adapters' factors stay in their slots."""
        for wrapper in self.layers.values():
            wrapper.base = None  # type: ignore[assignment]

    def rebind(self, model: torch.nn.Module) -> None:
        """Wrap a freshly loaded copy of the model again (waking from sleep level 2)."""
        rebind_model(model, self.layers)

    # ---- registry and host cache ------------------------------------------------

    def resolve(self, req: LoRARequest) -> LoRARequest:
        """The full request for one that names a known adapter only (``lora_int_id`` 0)."""
        req.validate()
        if req.lora_int_id == 0:
            adapter_id = self.ids_by_name.get(req.lora_name)
            if adapter_id is None:
                raise InvalidRequestError(
                    "lora_request.lora_name", req.lora_name,
                    f"no adapter of this name is loaded (known: {sorted(self.ids_by_name)})",
                )
            return self.known[adapter_id]
        return req

    def add_lora(self, req: LoRARequest) -> bool:
        """Register ``req`` and load it into the host cache (checked). True if it was new."""
        req = self.resolve(req)
        known = self.known.get(req.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (req.lora_name, req.lora_path):
            raise InvalidRequestError(
                "lora_request.lora_int_id", req.lora_int_id,
                f"already names adapter {known.lora_name!r} at {known.lora_path!r}",
            )
        other = self.ids_by_name.get(req.lora_name)
        if other is not None and other != req.lora_int_id:
            raise InvalidRequestError(
                "lora_request.lora_name", req.lora_name, f"already names adapter id {other}"
            )
        adapter = self._host(req)
        if known is None and req.lora_int_id in self.slot_of:  # removed, then added again
            self._write_slot(self.slot_of[req.lora_int_id], adapter)
        self.known[req.lora_int_id] = req
        self.ids_by_name[req.lora_name] = req.lora_int_id
        return known is None

    def _host(self, req: LoRARequest) -> LoRAAdapter:
        adapter = self.cpu.get(req.lora_int_id)
        if adapter is not None:
            self.cpu.move_to_end(req.lora_int_id)
            return adapter
        adapter = load_adapter(req, self.model_config, self.max_lora_rank, self.dtype)
        self.cpu[req.lora_int_id] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return adapter

    def remove_lora(self, adapter_id: int) -> bool:
        """Forget an adapter; running requests finish with it (its slot frees after them)."""
        req = self.known.pop(adapter_id, None)
        if req is not None and self.ids_by_name.get(req.lora_name) == adapter_id:
            del self.ids_by_name[req.lora_name]
        self.cpu.pop(adapter_id, None)
        self.pinned.discard(adapter_id)
        return req is not None

    def list_loras(self) -> list[int]:
        return sorted(self.known)

    def pin_lora(self, adapter_id: int, running_ids: Iterable[int] = ()) -> bool:
        if adapter_id not in self.known:
            raise InvalidRequestError("lora_id", adapter_id, "no adapter with this id is loaded")
        if adapter_id in self.pinned:
            return True
        if len(self.pinned) + 1 >= self.max_loras:
            raise InvalidRequestError(
                "lora_id", adapter_id,
                f"pinning it would leave none of max_loras={self.max_loras} slots for other adapters",
            )
        if not self.activate(adapter_id, set(running_ids), self.known[adapter_id]):
            raise InvalidRequestError("lora_id", adapter_id, "every slot is in use by running requests")
        self.pinned.add(adapter_id)
        return True

    # ---- device slots --------------------------------------------------------------

    def activate(self, adapter_id: int, running_ids: set[int], req: LoRARequest) -> bool:
        """Give the adapter a slot (evicting the LRU idle unpinned one); False if none is free.

        ``running_ids``: adapters of running requests, whose slots are never taken."""
        slot = self.slot_of.get(adapter_id)
        if slot is not None:
            self.slot_lru.move_to_end(adapter_id)
            return True
        if None in self.slots:
            slot = self.slots.index(None)
        else:
            victim = next(
                (i for i in self.slot_lru if i not in running_ids and i not in self.pinned), None
            )
            if victim is None:
                return False
            slot = self.slot_of.pop(victim)
            del self.slot_lru[victim]
            logger.debug("LoRA slot %d: adapter %d evicted for %d", slot, victim, adapter_id)
        adapter = self._host(req)  # may read it again: InvalidRequestError if it went bad
        self._write_slot(slot, adapter)
        self.slots[slot] = adapter_id
        self.slot_of[adapter_id] = slot
        self.slot_lru[adapter_id] = None
        return True

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        per_module: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), (a, b) in adapter.weights.items():
            fused, index = TARGET_MODULES[module]
            per_module.setdefault((layer, fused), {})[index] = (a.to(self.device), b.to(self.device))
        for key, wrapper in self.layers.items():
            factors = per_module.get(key)
            if factors:
                wrapper.set_slot(slot, factors)
            elif wrapper.loaded[slot]:
                wrapper.clear_slot(slot)

    # ---- one step ------------------------------------------------------------------

    def begin_step(self, adapter_ids: list[int], num_tokens: list[int]) -> None:
        """Set the step's token -> slot map: request i (in batch order) runs ``num_tokens[i]``
        rows with adapter ``adapter_ids[i]`` (0: none). No adapter in the step: no batch."""
        slots = [self.slot_of[i] if i else -1 for i in adapter_ids]
        if max(slots, default=-1) < 0:
            self.state.batch = None
            return
        num_rows = sum(num_tokens)
        segments: dict[int, list[int]] = {}  # slot -> its token rows, in batch order
        row = 0
        for slot, n in zip(slots, num_tokens, strict=True):
            if slot >= 0:
                segments.setdefault(slot, []).extend(range(row, row + n))
            row += n
        used = frozenset(segments)
        if len(used) == 1 and len(segments[next(iter(used))]) == num_rows:
            self.state.batch = LoRABatch(None, None, 1, num_rows, next(iter(used)), used)
            return
        k = max(used) + 1
        m = max(len(r) for r in segments.values())
        rows = np.zeros((k, m), dtype=np.int64)
        pad = np.zeros((k, m, 1), dtype=np.float32)
        for slot, token_rows in segments.items():
            rows[slot, : len(token_rows)] = token_rows
            pad[slot, : len(token_rows)] = 1.0
        self.state.batch = LoRABatch(
            rows=torch.from_numpy(rows.reshape(-1)).to(self.device),
            pad=None if pad.all() else torch.from_numpy(pad).to(device=self.device, dtype=self.dtype),
            num_slots=k,
            seg_len=m,
            single=None,
            slots=used,
        )

    def end_step(self) -> None:
        self.state.batch = None
