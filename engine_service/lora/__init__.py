"""LoRA adapters: PEFT checkpoints read (adapter.py), run batched per slot (layers.py),
held in host memory and device slots (manager.py)."""

from engine_service.lora.adapter import LoRAAdapter, load_adapter
from engine_service.lora.manager import LoRAManager

__all__ = ["LoRAAdapter", "LoRAManager", "load_adapter"]
