"""LoRA on the fused projections: every adapter of a step in one shrink and S expands.

Each wrapped ``FusedLinear`` keeps its base weight and, for ``max_loras`` device slots,
the adapters' low-rank factors stacked slot-major and zero-padded to ``max_lora_rank``
(R). A module with S output slices (q/k/v: 3, gate/up: 2, o and down: 1) holds

- ``lora_a``  ``[max_loras * S * R, in_features]``: rows ``[(slot*S + s)*R, +r)`` are
  slice s's A (``[r, in]``) of the adapter in ``slot``; the rest is zero;
- ``lora_bt[s]`` ``[max_loras * R, out_s]`` per slice: rows ``[slot*R, +r)`` hold slice
  s's ``(scale * B)^T`` (``[r, out_s]``) of the adapter in ``slot``; the rest is zero.

For a step whose highest used slot is k - 1 and whose token t runs the adapter in slot
``slot[t]`` (or none), ``LoRABatch.mask`` is the ``[T, k]`` one-hot of ``slot[t]`` and

    u = (x @ A[:k*S*R]^T) * mask                           # [T, k, S, R], mask over S*R
    y[:, slice s] += u[:, :, s, :].reshape(T, k*R) @ Bt[s][:k*R]    for each slice s

which is ``base(x) + scale_a * B_a (A_a x)`` for each token's adapter a, and ``base(x)``
for tokens without one: one shrink, one mask and S expands per projection, whatever the
number of adapters in the step (each expand only over its own output columns).
A step without LoRA requests sets no batch, and the projections run ``base`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.protocol.model_config import ModelConfig


@dataclass
class LoRABatch:
    """One step's token -> slot map, built once per step by the LoRA manager."""

    mask: torch.Tensor  # [num_tokens, num_slots] one-hot (activation dtype); zero row: no adapter
    num_slots: int  # k: 1 + the highest slot a token of this step uses
    slots: frozenset[int]  # the slots used this step


class LoRAState:
    """Shared by every wrapped projection: the current step's batch (None: no LoRA)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """A ``FusedLinear`` plus per-slot LoRA factors; see the module docstring for layouts."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        slices: list[tuple[int, int]],  # (first output row, rows) of each sub-projection
        max_loras: int,
        max_rank: int,
        state: LoRAState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.rank = max_rank
        self.state = state
        rows = max_loras * len(slices) * max_rank
        self.lora_a = torch.zeros(rows, in_features, dtype=dtype, device=device)
        self.lora_bt = [
            torch.zeros(max_loras * max_rank, n, dtype=dtype, device=device) for _, n in slices
        ]
        self.loaded: list[bool] = [False] * max_loras  # slot -> holds weights for this module

    def _rows(self, slot: int, index: int) -> slice:
        start = (slot * len(self.slices) + index) * self.rank
        return slice(start, start + self.rank)

    def set_slot(self, slot: int, factors: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write ``{slice index: (A [r, in], scaled B [out_slice, r])}`` into ``slot``; slices
        not given get zeros."""
        self.clear_slot(slot)
        for index, (a, b) in factors.items():
            rows = self._rows(slot, index)
            r = a.shape[0]
            self.lora_a[rows.start : rows.start + r].copy_(a)
            self.lora_bt[index][slot * self.rank : slot * self.rank + r].copy_(b.t())
        self.loaded[slot] = bool(factors)

    def clear_slot(self, slot: int) -> None:
        n = len(self.slices) * self.rank
        self.lora_a[slot * n : (slot + 1) * n].zero_()
        for bt in self.lora_bt:
            bt[slot * self.rank : (slot + 1) * self.rank].zero_()
        self.loaded[slot] = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = self.base(x)
        batch = self.state.batch
        if batch is None or not any(self.loaded[s] for s in batch.slots):
            return y
        k, r, num_tokens = batch.num_slots, self.rank, x.shape[0]
        num_slices = len(self.slices)
        shrunk = F.linear(x, self.lora_a[: k * num_slices * r])  # [T, k * S * R]
        shrunk = shrunk.view(num_tokens, k, num_slices, r).mul_(batch.mask[:, :, None, None])
        if num_slices == 1:
            return y.addmm_(shrunk.view(num_tokens, k * r), self.lora_bt[0][: k * r])
        for index, (start, size) in enumerate(self.slices):
            part = shrunk[:, :, index].reshape(num_tokens, k * r)  # [T, k*R], a small copy
            y[:, start : start + size].addmm_(part, self.lora_bt[index][: k * r])
        return y


# Our fused module under a layer -> (in_features, output slices) for ``config``.
def fused_module_slices(config: ModelConfig) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {
        "self_attn.qkv_proj": (h, [(0, q), (q, kv), (q + kv, kv)]),
        "self_attn.o_proj": (q, [(0, h)]),
        "mlp.gate_up_proj": (h, [(0, inter), (inter, inter)]),
        "mlp.down_proj": (inter, [(0, h)]),
    }


def wrap_model(
    model: nn.Module,
    config: ModelConfig,
    max_loras: int,
    max_rank: int,
    state: LoRAState,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[tuple[int, str], LoRALinear]:
    """Replace every layer's four fused projections by ``LoRALinear`` wrappers (in place).

    Returns ``{(layer index, "self_attn.qkv_proj" | ...): wrapper}``."""
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for i, layer in enumerate(model.layers):  # type: ignore[union-attr]
        for name, (in_features, slices) in fused_module_slices(config).items():
            parent_name, attr = name.split(".")
            parent = getattr(layer, parent_name)
            wrapper = LoRALinear(
                getattr(parent, attr), in_features, slices, max_loras, max_rank, state, dtype, device
            )
            setattr(parent, attr, wrapper)
            wrapped[(i, name)] = wrapper
    return wrapped
