"""The decoder's building blocks: norm scales, (fused) linear layers and their packed
forms, and the gated MLP. The decoder (decoder.py) and the MoE block (moe.py) build on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.dispatch import KernelOps
from kernels.onednn_linear import pack_weight, packed_linear
from kernels.panel_linear import PanelWeight, pack_panels, panel_linear
from tandem.protocol.model_config import ModelConfig

# A packed linear weight: an opaque oneDNN tensor, or float32 / int8 panels.
PackedWeight = torch.Tensor | PanelWeight
LINEAR_LAYOUTS = ("onednn", "panel", "panel_int8")


def pack_linear_weight(weight: torch.Tensor, layout: str) -> PackedWeight:
    """``[out, in]`` dense weight -> its packed form: "onednn" (oneDNN's blocked layout),
    "panel" (float32 16-column panels) or "panel_int8" (int8 panels, per-channel scales)."""
    if layout == "onednn":
        return pack_weight(weight)
    if layout in ("panel", "panel_int8"):
        return pack_panels(weight, quantize=layout == "panel_int8")
    raise ValueError(f"unknown linear layout {layout!r}; expected one of {LINEAR_LAYOUTS}")


def packed_matmul(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight from ``pack_linear_weight``."""
    if isinstance(packed, PanelWeight):
        return panel_linear(x, packed, bias)
    if not isinstance(packed, torch.Tensor):  # a quantized CUDA weight (gpu_quant.QuantizedLinearWeight)
        return packed.linear(x, bias)
    return packed_linear(x, packed, bias)


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNormWeight(nn.Module):
    """Holds one RMSNorm scale vector; the norm itself is ``ops.rms_norm``."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)  # [size]


class FusedLinear(nn.Module):
    """``y = x @ weight.T + bias`` whose output rows are stacked sub-projections."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        ops: KernelOps | None = None,
    ) -> None:
        super().__init__()
        # The backend's kernel for at most ``_small_rows_max`` rows (KernelOps.small_rows_linear).
        self._small_rows = ops.small_rows_linear if ops is not None else None
        self._small_rows_max = ops.small_rows_max if ops is not None else 0
        # [out_features, in_features]; None once pack() moved it into packed_weight.
        self.weight: nn.Parameter | None = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.packed_weight: PackedWeight | None = None  # see pack()

    def pack(self, layout: str = "onednn") -> None:
        """Pack the weight (``pack_linear_weight``'s layouts) and drop the dense copy."""
        if self.weight is None:
            return
        self.packed_weight = pack_linear_weight(self.weight, layout)
        self.weight = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` on whichever form the weight is in."""
        if self.packed_weight is not None:
            return packed_matmul(x, self.packed_weight, bias)
        if self._small_rows is not None and x.dim() == 2 and x.shape[0] <= self._small_rows_max:
            return self._small_rows(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``, act SiLU (SwiGLU) or GELU-tanh (GeGLU)."""

    def __init__(
        self,
        config: ModelConfig,
        ops: KernelOps,
        dtype: torch.dtype,
        device: torch.device,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        bias = config.features.mlp_bias
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        self.ops = ops
        self.act_and_mul = ops.gelu_tanh_and_mul if config.features.activation == "gelu_tanh" else ops.silu_and_mul
        # Output rows: [gate (intermediate) | up (intermediate)].
        self.gate_up_proj = FusedLinear(config.hidden_size, 2 * inter, bias, dtype, device, ops)
        self.down_proj = FusedLinear(inter, config.hidden_size, bias, dtype, device, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        return self.down_proj(self.act_and_mul(gate_up))
