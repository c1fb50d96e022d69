"""Linear layers over weights packed in 16-column panels (native CPU kernel).

``kernels/csrc/panel_linear_cpu.cpp`` computes ``x @ W.T * scale + bias`` reading the
weight once per block of up to 8 rows of ``x``. It serves two cases:

- **int8 weight-only quantization** (``--quantization int8``): ``W`` is stored as int8
  with one float32 scale per output channel (symmetric, ``scale = max|W[n, :]| / 127``)
  and widened to float32 in registers; activations stay float32. A decode step reads a
  quarter of the fp32 bytes.
- float32 panels, the same loop without the widening (the reference the int8 path is
  tested against, and a candidate for small batches).

``PanelWeight`` holds the packed tensor; ``panel_linear`` runs it. The reference
``panel_linear_reference`` unpacks and runs ``F.linear``: the kernel tests compare to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LANES = 16  # output columns per panel (one AVX-512 register of float32)


@dataclass(frozen=True)
class PanelWeight:
    """A ``[N, K]`` weight as ``[P, K, 16]`` panels (``P = ceil(N / 16)``, zero-padded).

    ``scale`` is ``[16P]`` float32 for int8 panels (the dequantized weight is
    ``panels * scale``), an empty tensor for float32 panels.
    """

    panels: torch.Tensor  # [P, K, 16] int8 or float32, contiguous
    scale: torch.Tensor  # [16P] float32, or empty
    out_features: int  # N

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size() + self.scale.numel() * 4


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (``[N, K]`` int8, ``[N]`` float32 scale), symmetric per output
    channel: ``q = round(w / scale)`` with ``scale = max|w[n, :]| / 127`` (1 for a zero row)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_panels(weight: torch.Tensor, quantize: bool) -> PanelWeight:
    """``[N, K]`` weight -> panels; int8 with per-channel scales when ``quantize``."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    num_panels = -(-n // LANES)
    if quantize:
        values, scale = quantize_int8(weight)
        scale = F.pad(scale, (0, num_panels * LANES - n), value=1.0).contiguous()
    else:
        values, scale = weight.detach().float(), torch.empty(0)
    padded = F.pad(values, (0, 0, 0, num_panels * LANES - n))  # [16P, K]
    panels = padded.view(num_panels, LANES, k).transpose(1, 2).contiguous()  # [P, K, 16]
    return PanelWeight(panels=panels, scale=scale, out_features=n)


def unpack_panels(weight: PanelWeight) -> torch.Tensor:
    """The ``[N, K]`` float32 weight the panels stand for (dequantized for int8)."""
    p, k, _ = weight.panels.shape
    dense = weight.panels.transpose(1, 2).reshape(p * LANES, k).float()
    if weight.scale.numel():
        dense = dense * weight.scale[:, None]
    return dense[: weight.out_features]


def panel_linear(
    x: torch.Tensor,  # [M, K] float32
    weight: PanelWeight,
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    """``x @ W.T + bias`` natively (needs ``kernels.cpu_ops.native_available()``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    empty = torch.empty(0)
    torch.ops.tandem_cpu.panel_linear(
        out, x, weight.panels, weight.scale, empty if bias is None else bias.float().contiguous()
    )
    return out


def panel_linear_reference(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The same product through ``F.linear`` on the unpacked weight."""
    return F.linear(x.float(), unpack_panels(weight), None if bias is None else bias.float())
