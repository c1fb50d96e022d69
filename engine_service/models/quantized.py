"""Matrices kept as int8 with group scales (GGUF Q8_0), as the loader hands them over.

The GGUF reader (gguf_weights.py) produces them, the weight loader (loader.py) collects
them per parameter, and the decoder (decoder.py) packs them into grouped int8 panels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q8_0_GROUP = 32  # k per Q8_0 block (one float16 scale, 32 int8 values)


@dataclass(frozen=True)
class QuantizedRows:
    """A Q8_0 matrix as it is stored: ``values`` int8 ``[N, K]``, ``scales`` float32
    ``[N, K / 32]``; the weight is ``values * scales.repeat_interleave(32, dim=1)``."""

    values: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales.repeat_interleave(Q8_0_GROUP, dim=1)

    def rows(self, index: torch.Tensor) -> QuantizedRows:
        return QuantizedRows(self.values[index].contiguous(), self.scales[index].contiguous())
