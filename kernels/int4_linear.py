"""4-bit weights as they are (GGUF Q4_0 / Q4_1 / Q4_K, GPTQ, AWQ; and 5-bit GGUF Q5_0 /
Q5_1 / Q5_K, with a plane of fifth bits) in tiles of two 16-column panels, run by the native
kernel ``kernels/csrc/int4_linear_cpu.cpp`` (its comment has the layout).

The one input form is ``engine_service.models.quantized.Int4Rows``' (codes two a byte,
per-group float32 scales and mins: ``W = code * scale + min``); ``pack_int4_panels``
re-orders the codes for the kernel and stores a group's scales and mins side by side, in
float16 where that is exact (GGUF Q4_0, Q4_1, Q5_0, Q5_1: their scales are float16 in the
file) and float32 otherwise (Q4_K's 6-bit sub-block scales times a float16 need up to 17
bits).
A 4-bit weight is a ``PanelWeight`` with uint8 panels, ``group = 32``: every entry point of
the panel kernel (``panel_linear``, ``panel_linear_argmax``, the native decode loop's
``tandem_cpu::panel_linear``) hands uint8 panels to the 4-bit kernel.

The kernel quantizes x per row and group of 32 columns as llama.cpp does for its 4-bit dot
products (int8, ``d = max|x| / 127``), and by default also the rounding residual (a second
int8, ``x' = d (q1 + q2 / 256)``: ~16 bits; ``int4_x_bits`` switches the process to the one
int8 of llama.cpp's numerics), so its product is ``x' @ W.T``, not ``x @ W.T``.
``int4_linear_reference`` computes the first (through the kernel's own quantization of x,
``torch.ops.tandem_cpu.int4_quantize_x``, or ``quantize_x`` in PyTorch),
``unpack_int4_panels`` gives W for the second. Prefill-sized products run the kernel too:
``F.linear`` on the dequantized weight was 2-3x slower at 64-2048 rows of bench shapes
(2-core Zen 4: 3072 x 576 at 2048 rows, kernel 21 ms with 16-bit x, 12 ms with 8-bit,
dequantize + F.linear 48 ms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.panel_linear import LANES, PanelWeight

INT4_GROUP = 32  # k per scale and min in the panels, and per int8 block of x
TILE = 2 * LANES  # output columns per tile: two 16-column panels
TILE_GROUP_BYTES = 512  # a group of 32 k of a tile: 2 panels x 4 chunks x 64 bytes
BIT_BYTES = 128  # and (5-bit) its fifth bits: 2 panels x 4 chunks x 2 halves x 8 bytes


def int4_panels_shape(out_features: int, in_k: int, five: bool = False) -> tuple[int, int, int]:
    """Shape of ``pack_int4_panels``' uint8 panels for an ``[out_features, in_k]`` weight
    (``five``: with fifth bits)."""
    return (-(-out_features // TILE), in_k // INT4_GROUP, TILE_GROUP_BYTES + (BIT_BYTES if five else 0))


def check_int4(in_k: int, group: int) -> None:
    """Raise ValueError unless the kernel takes 4-bit weights of inner size ``in_k`` in groups
    of ``group``: both multiples of 32 (a group of more is stored as 32s, its scales repeated)."""
    if group <= 0 or group % INT4_GROUP:
        raise ValueError(f"4-bit panels need a group that is a multiple of {INT4_GROUP}, got {group}")
    if in_k <= 0 or in_k % group:
        raise ValueError(f"4-bit panels need K a multiple of the group: K = {in_k}, group = {group}")


def _exact_half(t: torch.Tensor) -> bool:
    half = t.to(torch.float16)
    return bool(torch.isfinite(half).all()) and bool((half.float() == t).all())


def pack_int4_panels(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int, high: torch.Tensor | None = None
) -> PanelWeight:
    """``Int4Rows``' parts (``codes`` uint8 ``[N, K / 2]``, column 2j in the low nibble;
    ``scales`` and ``mins`` ``[N, K / group]``; 5-bit: ``high`` uint8 ``[N, K / 8]``, bit b
    of byte i column 8i + b's fifth bit) -> the kernel's layout: uint8 panels ``[Q, K / 32,
    512]`` (Q = ceil(N / 32) tiles of two 16-column panels; ``[q, g, 256 t + 64 c + 4 j +
    b]``: column 32q + 16t + j, k = 32g + 8c + b in the low nibble and + 4 in the high one;
    5-bit: ``[Q, K / 32, 640]``, each group's fifth bits after its codes, ``[q, g, 512 + 64 t
    + 16 c + 8 h + i]`` bit e for byte 8i + e of chunk c's low (h = 0) or high nibbles) and
    scale ``[Q, K / 32, 64]`` (``[q, g, 32 t + j]`` the scale of that column over the group,
    ``[q, g, 32 t + 16 + j]`` its min), float16 when every scale and min is exactly a
    float16, else float32. Rows of several matrices concatenated (``torch.cat`` of each
    part) make one fused weight."""
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be 2-D uint8 [out, in / 2], got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape[0], 2 * codes.shape[1]
    check_int4(k, group)
    if tuple(scales.shape) != (n, k // group) or tuple(mins.shape) != (n, k // group):
        raise ValueError(f"scales and mins must be [{n}, {k // group}] for [{n}, {k}] codes in groups of {group}, "
                         f"got {tuple(scales.shape)} and {tuple(mins.shape)}")
    q, g = -(-n // TILE), k // INT4_GROUP
    unpacked = torch.stack((codes & 0x0F, codes >> 4), dim=-1).reshape(n, k)  # one code a byte
    unpacked = F.pad(unpacked, (0, 0, 0, q * TILE - n))  # [32Q, K], padded rows code 0
    # [q, t, j, g, c, h, b] (column 32q + 16t + j, k = 32g + 8c + 4h + b) -> [q, g, t, c, j, b, h].
    split = unpacked.view(q, 2, LANES, g, 4, 2, 4).permute(0, 3, 1, 4, 2, 6, 5)
    panels = (split[..., 0] | (split[..., 1] << 4)).reshape(q, g, TILE_GROUP_BYTES)
    if high is not None:
        if tuple(high.shape) != (n, k // 8) or high.dtype != torch.uint8:
            raise ValueError(f"high must be uint8 [{n}, {k // 8}], got {high.dtype} {tuple(high.shape)}")
        bits = ((high[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(n, k)
        bits = F.pad(bits, (0, 0, 0, q * TILE - n))
        # [q, t, j, g, c, h, b] -> [q, g, t, c, h, j, b]: 64 bits a half-chunk, bit 4j + b.
        bits = bits.view(q, 2, LANES, g, 4, 2, 4).permute(0, 3, 1, 4, 5, 2, 6).reshape(q, g, BIT_BYTES, 8)
        packed_bits = (bits << torch.arange(8, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)
        panels = torch.cat((panels, packed_bits), dim=2)
    panels = panels.contiguous()
    repeat = group // INT4_GROUP
    parts = []
    for part in (scales, mins):
        part = part.detach().float().repeat_interleave(repeat, dim=1) if repeat > 1 else part.detach().float()
        part = F.pad(part, (0, 0, 0, q * TILE - n))  # padded rows: scale 0, min 0
        parts.append(part.view(q, 2, LANES, g).permute(0, 3, 1, 2))  # [Q, G, t, 16]
    scale = torch.cat(parts, dim=3).reshape(q, g, 2 * TILE).contiguous()  # [Q, G, 64]
    if _exact_half(scale):
        scale = scale.to(torch.float16)
    return PanelWeight(panels=panels, scale=scale, out_features=n, in_k=k, group=INT4_GROUP)


def is_int4(weight: PanelWeight) -> bool:
    return weight.panels.dtype == torch.uint8


def unpack_int4_panels(weight: PanelWeight) -> torch.Tensor:
    """The ``[N, K]`` float32 weight 4-bit (or 5-bit) panels stand for (``code * scale + min``)."""
    panels, k = weight.panels, weight.in_k
    q, g = panels.shape[0], k // INT4_GROUP
    nibbles = panels[:, :, :TILE_GROUP_BYTES]
    split = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).view(q, g, 2, 4, LANES, 4, 2)  # [q, g, t, c, j, b, h]
    if panels.shape[2] > TILE_GROUP_BYTES:  # fifth bits: [q, g, t, c, h, j, b]
        bits = (panels[:, :, TILE_GROUP_BYTES:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
        bits = bits.reshape(q, g, 2, 4, 2, LANES, 4).permute(0, 1, 2, 3, 5, 6, 4)  # [q, g, t, c, j, b, h]
        split = split + (bits << 4)
    codes = split.permute(0, 2, 4, 1, 3, 6, 5).reshape(q * TILE, k)  # [32Q, K]
    scale = weight.scale.float().view(q, g, 2, 2, LANES)  # [q, g, t, scale | min, j]
    per_k = [
        scale[:, :, :, part].permute(0, 2, 3, 1).reshape(q * TILE, g).repeat_interleave(INT4_GROUP, dim=1)
        for part in (0, 1)
    ]
    dense = codes.float() * per_k[0]
    dense += per_k[1]
    return dense[: weight.out_features]


def int4_x_bits(bits: int = 0) -> int:
    """The process's precision of x in 4-bit products (``panel_linear`` and the native decode
    loop alike): 16 (default; x as two int8 parts, ``q1 + q2 / 256`` steps of ``max|x| / 127``
    per 32 columns) or 8 (``q1`` alone: llama.cpp's Q8 activations). Sets it to ``bits``
    unless 0; returns the setting before. Needs the native kernels."""
    return int(torch.ops.tandem_cpu.int4_x_bits(bits))


def quantize_x(x: torch.Tensor, x_bits: int = 16) -> torch.Tensor:
    """``[M, K]`` float32 -> x as the kernel quantizes it, dequantized (``x'``), in PyTorch:
    per row and group of 32 columns ``d = max|x| / 127``, ``t = x / d``, ``q1 = round(t)``
    (ties to even) and with ``x_bits = 16`` ``q2 = round(256 (t - q1))``; ``x' = d q1``
    or ``d (q1 + q2 / 256)``. The kernel's float32 arithmetic (``int4_quantize_x``, its exact
    copy) may round a value lying within an ulp of a tie the other way."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // INT4_GROUP, INT4_GROUP)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    t = blocks * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q1 = torch.round(t).clamp_(-127, 127)
    if x_bits == 8:
        return (q1 * (amax / 127.0)).reshape(m, k)
    q2 = torch.round((t - q1) * 256.0).clamp_(-127, 127)
    return ((256.0 * q1 + q2) * (amax / 127.0 / 256.0)).reshape(m, k)


def int4_linear_reference(
    x: torch.Tensor,
    weight: PanelWeight,
    bias: torch.Tensor | None,
    x_bits: int = 0,
    native_quantization: bool = True,
) -> torch.Tensor:
    """What the kernel computes, through ``F.linear``: ``x' @ W.T + bias`` with ``x'`` x as
    the kernel quantizes it to ``x_bits`` (0: the process's setting; through its own op when
    ``native_quantization``, else ``quantize_x``) and W the panels' dequantized weight."""
    x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    bits = x_bits or int4_x_bits()
    dequantized_x = torch.ops.tandem_cpu.int4_quantize_x(x, bits) if native_quantization else quantize_x(x, bits)
    return F.linear(dequantized_x, unpack_int4_panels(weight), None if bias is None else bias.float())
