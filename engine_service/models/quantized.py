"""Matrices kept as int8 with group scales (GGUF Q8_0, Q5_0, Q6_K) or as 4-bit codes with
group scales and mins (GGUF Q4_*), as the loader hands them over.

The GGUF reader (gguf_weights.py) produces them, the weight loader (loader.py) collects
them per parameter, and the decoder (decoder.py) packs them into grouped int8 panels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q8_0_GROUP = 32  # k per Q8_0 block (one float16 scale, 32 int8 values)


@dataclass(frozen=True)
class QuantizedRows:
    """An int8 matrix with group scales as it is stored (Q8_0: its values; Q5_0, Q6_K: their
    5- or 6-bit values less 16 or 32): ``values`` int8 ``[N, K]``, ``scales`` float32
    ``[N, K / group]``; the weight is ``values * scales.repeat_interleave(group, dim=1)``."""

    values: torch.Tensor
    scales: torch.Tensor
    group: int = Q8_0_GROUP

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales.repeat_interleave(self.group, dim=1)

    def rows(self, index: torch.Tensor) -> QuantizedRows:
        return QuantizedRows(self.values[index].contiguous(), self.scales[index].contiguous(), self.group)


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
    - ``high``: uint8 ``[N, K / 8]`` or None: 5-bit formats (GGUF Q5_0, Q5_1, Q5_K) keep
      their fifth bit here, bit ``b`` of byte ``i`` for column ``8i + b``, which adds 16 to
      that column's code (codes 0..31).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    group: int
    perm: torch.Tensor | None = None
    high: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    def unpacked(self) -> torch.Tensor:
        """uint8 ``[N, K]`` codes, one a byte (with the fifth bits, if any)."""
        low = self.codes & 0x0F
        high = self.codes >> 4
        codes = torch.stack((low, high), dim=-1).reshape(self.shape)
        if self.high is not None:
            bits = (self.high[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [N, K / 8, 8]
            codes = codes + (bits.reshape(self.shape) << 4)
        return codes

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
            None if self.high is None else self.high[index].contiguous(),
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
