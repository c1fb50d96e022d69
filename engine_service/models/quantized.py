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


@dataclass(frozen=True)
class Int4Rows:
    """A 4-bit matrix in the one form every 4-bit format is converted to (GGUF Q4_0, Q4_1
    and Q4_K; GPTQ; AWQ), as the loader hands it to the model.

    - ``codes``: uint8 ``[N, K / 2]``, two unsigned 4-bit codes a byte: column ``2j`` in
      the low nibble, ``2j + 1`` in the high one.
    - ``scales``, ``mins``: float32 ``[N, K / group]``.
    - the weight is ``codes[n, k] * scales[n, k // group] + mins[n, k // group]``
      (Q4_0: ``mins = -8 * scales``; GPTQ/AWQ: ``mins = -scales * zeros``).
    - ``perm``: int64 ``[K]`` or None. With it the matrix above is the checkpoint's weight
      with its input columns reordered (GPTQ act-order sorted by group):
      ``y = x[:, perm] @ weight.T``; ``dequantize`` returns the checkpoint's own order.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    group: int
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    def unpacked(self) -> torch.Tensor:
        """uint8 ``[N, K]`` codes, one a byte."""
        low = self.codes & 0x0F
        high = self.codes >> 4
        return torch.stack((low, high), dim=-1).reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]`` in the checkpoint's column order."""
        weight = self.unpacked().float() * self.scales.repeat_interleave(self.group, dim=1)
        weight += self.mins.repeat_interleave(self.group, dim=1)
        if self.perm is None:
            return weight
        out = torch.empty_like(weight)
        out[:, self.perm] = weight
        return out

    def rows(self, index: torch.Tensor) -> Int4Rows:
        return Int4Rows(
            self.codes[index].contiguous(),
            self.scales[index].contiguous(),
            self.mins[index].contiguous(),
            self.group,
            self.perm,
        )


@dataclass(frozen=True)
class Fp8Rows:
    """An FP8 matrix as a compressed-tensors checkpoint stores it, when the loader is asked
    to hand it over as stored (``keep_fp8``; the CUDA kernel takes it, see gpu_quant.py):
    ``values`` float8_e4m3fn ``[N, K]``, ``scales`` float32 ``[1]`` (per tensor) or
    ``[N, 1]`` (per output channel); the weight is ``values.float() * scales``."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def per_channel(self) -> bool:
        return self.scales.dim() == 2

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``."""
        return self.values.float() * self.scales

    def rows(self, index: torch.Tensor) -> Fp8Rows:
        scales = self.scales[index].contiguous() if self.per_channel else self.scales
        return Fp8Rows(self.values[index].contiguous(), scales)

    def row_scales(self) -> torch.Tensor:
        """float32 ``[N, 1]``: each row's scale (a per-tensor scale repeated)."""
        return self.scales.expand(self.values.shape[0], 1).contiguous() if not self.per_channel else self.scales
