"""LoRA on the fused projections: the step's tokens grouped by adapter, two batched matmuls.

Each wrapped ``FusedLinear`` keeps its base weight and, for ``max_loras`` device slots,
the adapters' low-rank factors zero-padded to ``max_lora_rank`` (R). A module with S
output slices (q/k/v: 3, gate/up: 2, o and down: 1) holds

- ``lora_a`` ``[max_loras, in_features, S * R]``: in ``slot``, columns ``[s*R, s*R + r)``
  are slice s's ``A^T`` (``[in, r]``); the rest is zero;
- ``lora_b`` ``[max_loras, S * R, out_features]``: in ``slot``, rows ``[s*R, s*R + r)`` x
  slice s's output columns hold ``(scale * B_s)^T`` (``[r, out_s]``); block-diagonal, so
  one expand writes every slice.

``LoRABatch`` (built once per step) lists the step's adapter tokens slot by slot, each
slot's segment padded to the longest (m rows): ``rows [k * m]`` are token indices. Then

    u = bmm(x[rows].view(k, m, in), A[:k])        # [k, m, S*R]; padding rows zeroed
    y.index_add_(0, rows, bmm(u, B[:k]).view(k * m, out))

which is ``base(x) + scale_a * B_a (A_a x)`` for each token's adapter a, and ``base(x)``
for tokens without one: each token meets only its own adapter's factors (Punica's
segmented matmul, padded to equal segments so two ``bmm`` calls do it). A step where
every token runs one adapter takes two plain matmuls; a step without LoRA requests sets
no batch, and the projections run ``base`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.protocol.model_config import ModelConfig


@dataclass
class LoRABatch:
    """One step's adapter tokens grouped by slot, built once per step by the LoRA manager."""

    rows: torch.Tensor | None  # [k * m] int64: slot j's tokens at [j*m, (j+1)*m), then padding
    # (row 0); None when ``single`` is set
    pad: torch.Tensor | None  # [k, m, 1] 1.0 for a token, 0.0 for padding; None: no padding
    num_slots: int  # k: 1 + the highest slot a token of this step uses
    seg_len: int  # m: tokens of the busiest slot
    single: int | None  # the slot, when every token of the step runs that one adapter
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
        width, out_features = len(slices) * max_rank, sum(n for _, n in slices)
        self.lora_a = torch.zeros(max_loras, in_features, width, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        self.loaded: list[bool] = [False] * max_loras  # slot -> holds weights for this module

    def set_slot(self, slot: int, factors: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write ``{slice index: (A [r, in], scaled B [out_slice, r])}`` into ``slot``; slices
        not given get zeros."""
        self.clear_slot(slot)
        for index, (a, b) in factors.items():
            start, size = self.slices[index]
            col, r = index * self.rank, a.shape[0]
            self.lora_a[slot, :, col : col + r].copy_(a.t())
            self.lora_b[slot, col : col + r, start : start + size].copy_(b.t())
        self.loaded[slot] = bool(factors)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.loaded[slot] = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = self.base(x)
        batch = self.state.batch
        if batch is None or not any(self.loaded[s] for s in batch.slots):
            return y
        if batch.single is not None:
            return y.addmm_(x @ self.lora_a[batch.single], self.lora_b[batch.single])
        k, m = batch.num_slots, batch.seg_len
        assert batch.rows is not None  # set whenever single is None
        grouped = x.index_select(0, batch.rows).view(k, m, x.shape[1])
        shrunk = torch.bmm(grouped, self.lora_a[:k])  # [k, m, S*R]
        if batch.pad is not None:
            shrunk.mul_(batch.pad)
        return y.index_add_(0, batch.rows, torch.bmm(shrunk, self.lora_b[:k]).view(k * m, -1))


def rebind_model(model: nn.Module, wrapped: dict[tuple[int, str], LoRALinear]) -> None:
    """Put existing wrappers (their adapters' factors kept) around a freshly loaded copy
    of the same model: each takes the new projection as its ``base`` (sleep level 2)."""
    for (i, name), wrapper in wrapped.items():
        parent_name, attr = name.split(".")
        parent = getattr(model.layers[i], parent_name)  # type: ignore[index]
        wrapper.base = getattr(parent, attr)
        setattr(parent, attr, wrapper)


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
