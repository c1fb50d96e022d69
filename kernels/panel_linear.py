"""Linear layers over weights packed in 16-column panels (native CPU kernel).

``kernels/csrc/panel_linear_cpu.cpp`` computes ``x @ W.T * scale + bias`` reading the
weight once per register block of rows of ``x`` (8 rows with AVX-512, 6 with AVX2; its
build targets the CPU it runs on). It serves two cases:

- **int8 weight-only quantization** (``--quantization int8``): ``W`` is stored as int8
  with one float32 scale per output channel (symmetric, ``scale = max|W[n, :]| / 127``);
  activations are not quantized to 8 bits: the kernel rounds each row of ``x`` to 16-bit
  fixed point per block of 256 columns (a step of 2^-15 of the block's largest value,
  far below the int8 weights' own error) so that a 16-bit pair dot product (AVX-512
  VNNI's, or AVX2's vpmaddwd) does the multiply-adds. A decode step reads a quarter of the fp32 bytes.
  On AVX2, products of 16 rows or more dequantize a tile of panels at a time into float32
  (in cache) and run the float32 loop instead, on unrounded x. Prefill-sized products
  (``gemm_min_rows``) run the dequantized weight through ``torch.mm`` where that is faster.
- **grouped int8** (GGUF Q8_0 and the like, ``pack_panels_grouped``): the int8 values
  used as they are, with one float16 scale per output row and group of ``group``
  consecutive k (``W[n, k] = scale[n, k // group] * q[n, k]``; Q8_0: ``group = 32``, whose
  scales are float16 in the file: exact; other scales are rounded to the nearest float16).
  The panels are laid out as per-channel int8 panels; ``scale`` is ``[P, K / group, 16]``
  float16 (``[p, g, j]`` scales ``W[16p + j, group g : group (g + 1)]``, padded columns
  1.0), widened to float32 in registers: half the bytes of float32 scales streamed beside
  the panels (a sixteenth of the int8 bytes at group 32, not an eighth).
  Invariants: ``K % group == 0``, ``group`` even and dividing ``X_BLOCK`` (a group lies in
  one 16-bit block of x). x is rounded exactly as for per-channel int8; the kernel flushes
  its int32 sums into float32 every group, times the group's scales (and x's block step
  once a block). Every int8 path
  (AVX-512 with or without VNNI, AVX2's integer and dequantized-tile loops, the portable
  loops, the ``torch.mm`` path, the argmax, the native decode loop, which passes
  ``scale`` through) takes either form: the kernel tells them apart by ``scale.dim()``.
- float32 panels, the same loop without the widening: the engine's linear layers at
  every batch size on AVX2 (a hand-scheduled inner loop, ahead of torch.mm at decode and
  prefill sizes), and below ``gemm_min_rows`` rows elsewhere.

Greedy sampling from a float32 LM head at a few rows (``panel_linear_argmax_screened``)
reads an int8 copy of it (``ArgmaxScreen``) and recomputes in float32 only the tiles that
could hold the maximum: the same tokens, bit for bit, for a quarter of the bytes.

``PanelWeight`` holds the packed tensor; ``panel_linear`` runs it. The reference
``panel_linear_reference`` unpacks and runs ``F.linear`` (on float32 ``x``, rounded to
16 bits where the int8 kernel rounds it): the kernel tests compare to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

LANES = 16  # output columns per panel (one AVX-512 register of float32)


@dataclass(frozen=True)
class PanelWeight:
    """A ``[N, K]`` weight as ``[P, K, 16]`` panels (``P = ceil(N / 16)``, zero-padded).

    ``scale`` is ``[16P]`` float32 for int8 panels with per-channel scales (the dequantized
    weight is ``panels * scale``), ``[P, K / group, 16]`` float16 for int8 panels with
    group scales (``group > 0``), an empty tensor for float32 panels.
    uint8 panels are 4-bit weights (``kernels/int4_linear.py``: panels ``[P, K / 8, 64]``,
    scale ``[P, K / 32, 32]`` float16 or float32 with the groups' scales and mins, group 32).
    """

    # float32 [P, K, 16]: [p, k, j] = W[16p + j, k]; int8 [P, ceil(K / 2), 32]: k in pairs,
    # [p, i, 2j + h] = W[16p + j, 2i + h] (the kernel's 16-bit pair dot product). Contiguous.
    panels: torch.Tensor
    scale: torch.Tensor  # [16P] float32 or (group > 0) [P, K / group, 16] float16, or empty; contiguous
    out_features: int  # N
    in_k: int  # K
    group: int = 0  # k per group scale (int8 only); 0: one scale per output channel


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
    if quantize:
        panels = _int8_panels(values)
    else:
        padded = F.pad(values, (0, 0, 0, num_panels * LANES - n))  # [16P, K]
        panels = padded.view(num_panels, LANES, k).transpose(1, 2)  # [P, K, 16]
    return PanelWeight(panels=panels.contiguous(), scale=scale, out_features=n, in_k=k)


def _int8_panels(values: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int8 -> contiguous ``[P, ceil(K / 2), 32]`` panels (k in pairs, zero-padded)."""
    n, k = values.shape
    num_panels, k2 = -(-n // LANES), -(-k // 2)
    padded = F.pad(values, (0, 2 * k2 - k, 0, num_panels * LANES - n))  # [16P, 2 K2]
    return padded.view(num_panels, LANES, k2, 2).permute(0, 2, 1, 3).reshape(num_panels, k2, 2 * LANES).contiguous()


def check_group(in_k: int, group: int) -> None:
    """Raise ValueError unless ``group`` is a group size the kernel takes for inner size
    ``in_k``: even, dividing ``X_BLOCK`` (256), and dividing ``in_k``."""
    if group <= 0 or group % 2 or X_BLOCK % group:
        raise ValueError(f"group must be an even divisor of {X_BLOCK} (e.g. 32 for GGUF Q8_0), got {group}")
    if in_k <= 0 or in_k % group:
        raise ValueError(f"grouped int8 weights need K a multiple of the group: K = {in_k}, group = {group}")


def pack_panels_grouped(values: torch.Tensor, scales: torch.Tensor, group: int = 32) -> PanelWeight:
    """Int8 values ``[N, K]`` with group scales ``[N, K // group]`` (``W[n, k] = scales[n,
    k // group] * values[n, k]``, GGUF Q8_0 with ``group = 32``) -> int8 panels with those
    scales, the values unchanged. Rows of several such tensors concatenated (``torch.cat``
    of values and of scales along dim 0) make one fused weight.

    The scales (any float dtype) are stored as float16, rounded to nearest (ties to even):
    exact for Q8_0's, which are float16 in the file. A finite scale beyond float16's range
    (|scale| > 65504, which would round to inf) raises ValueError; below 2^-14 a scale
    keeps fewer bits (float16 subnormals), at or below 2^-25 it becomes 0."""
    if values.dim() != 2 or values.dtype != torch.int8:
        raise ValueError(f"values must be 2-D int8 [out, in], got {values.dtype} {tuple(values.shape)}")
    n, k = values.shape
    check_group(k, group)
    if tuple(scales.shape) != (n, k // group):
        raise ValueError(f"scales must be [{n}, {k // group}] for [{n}, {k}] values in groups of {group}, "
                         f"got {tuple(scales.shape)}")
    half = scales.detach().to(torch.float16)
    if bool((torch.isinf(half) & torch.isfinite(scales.detach())).any()):
        raise ValueError("group scales must lie in float16's range (|scale| <= 65504): they are stored as float16")
    num_panels = -(-n // LANES)
    padded = F.pad(half, (0, 0, 0, num_panels * LANES - n), value=1.0)  # [16P, G]
    scale = padded.view(num_panels, LANES, k // group).transpose(1, 2).contiguous()  # [P, G, 16] float16
    return PanelWeight(panels=_int8_panels(values.detach()), scale=scale, out_features=n, in_k=k, group=group)


def panels_shape(out_features: int, in_k: int, quantize: bool) -> tuple[int, int, int]:
    """Shape of ``pack_panels``' panels for an ``[out_features, in_k]`` weight (int8 ones:
    also of ``pack_panels_grouped``'s)."""
    num_panels = -(-out_features // LANES)
    return (num_panels, -(-in_k // 2), 2 * LANES) if quantize else (num_panels, in_k, LANES)


def group_scale_shape(out_features: int, in_k: int, group: int) -> tuple[int, int, int]:
    """Shape of ``pack_panels_grouped``' scale (float16) for an ``[out_features, in_k]`` weight."""
    check_group(in_k, group)
    return (-(-out_features // LANES), in_k // group, LANES)


class PanelArena:
    """One buffer on transparent huge pages (``kernels.cpu_ops.empty_on_huge_pages``) for
    panel tensors of known shapes, placed in order, each 64-byte aligned; and, where
    ``scale_shapes`` lists them, a second (float16) one for the group scales of the
    grouped weights among them, placed in the same order (``group_scale_shape``; a grouped
    weight's scale is streamed with its panels: a sixteenth of their bytes at group 32).

    A decode step streams every weight once; with 4 KiB pages that is a TLB miss every
    4 KiB, which huge pages avoid (the decode time it saved: benchmarks/NOTES.md). One
    buffer rather than one per weight: huge pages round each
    allocation up to 2 MiB. The buffer's pages are touched only as panels are placed, so
    packing weight by weight and placing each at once holds about one copy of the model.
    """

    def __init__(
        self,
        shapes: list[tuple[int, ...]],
        dtype: torch.dtype,
        scale_shapes: list[tuple[int, ...]] | None = None,
    ) -> None:
        self._slots, self._buffer = _arena_slots(shapes, dtype)
        self._next = 0
        # Grouped weights' scales: their own slots, or (None) left where they are.
        self._scale_slots, self._scale_buffer = _arena_slots(scale_shapes, torch.float16) if scale_shapes else ([], None)
        self._next_scale = 0

    def place(self, weight: PanelWeight) -> PanelWeight:
        """``weight`` with its panels copied into the next slot (which must fit them), and,
        for a grouped weight when the arena holds scale slots, its scale into the next
        scale slot."""
        if self._next >= len(self._slots):
            raise ValueError(f"PanelArena: all {len(self._slots)} slots are placed")
        offset, shape = self._slots[self._next]
        panels = weight.panels
        if tuple(panels.shape) != shape or panels.dtype != self._buffer.dtype:
            raise ValueError(
                f"PanelArena: slot {self._next} holds {shape} {self._buffer.dtype}, "
                f"got {tuple(panels.shape)} {panels.dtype}"
            )
        scale = weight.scale
        if weight.group > 0 and self._scale_buffer is not None:
            if self._next_scale >= len(self._scale_slots):
                raise ValueError(f"PanelArena: all {len(self._scale_slots)} scale slots are placed")
            scale_offset, scale_shape = self._scale_slots[self._next_scale]
            if tuple(scale.shape) != scale_shape or scale.dtype != self._scale_buffer.dtype:
                raise ValueError(
                    f"PanelArena: scale slot {self._next_scale} holds {scale_shape} {self._scale_buffer.dtype}, "
                    f"got {tuple(scale.shape)} {scale.dtype}"
                )
            self._next_scale += 1
            scale = self._scale_buffer[scale_offset : scale_offset + scale.numel()].view(scale_shape)
            scale.copy_(weight.scale)
        self._next += 1
        view = self._buffer[offset : offset + panels.numel()].view(shape)
        view.copy_(panels)
        return replace(weight, panels=view, scale=scale)


def _arena_slots(
    shapes: list[tuple[int, ...]], dtype: torch.dtype
) -> tuple[list[tuple[int, tuple[int, ...]]], torch.Tensor]:
    """(offset, shape) of each tensor in one huge-page buffer, each 64-byte aligned; the buffer."""
    from kernels.cpu_ops import empty_on_huge_pages

    align = 64 // torch.empty(0, dtype=dtype).element_size()  # elements per 64 bytes
    slots: list[tuple[int, tuple[int, ...]]] = []
    total = 0
    for shape in shapes:
        slots.append((total, tuple(shape)))
        total += -(-torch.Size(shape).numel() // align) * align
    return slots, empty_on_huge_pages((max(total, 1),), dtype)


def onto_huge_pages(weights: list[PanelWeight]) -> list[PanelWeight]:
    """The same weights with their panels (and grouped weights' scales) copied into one
    ``PanelArena``. The panels must share a dtype; the input weights are left as they were."""
    if not weights:
        return []
    dtype = weights[0].panels.dtype
    if any(w.panels.dtype != dtype for w in weights):
        raise ValueError("onto_huge_pages: the panels must share a dtype")
    scale_shapes = [tuple(w.scale.shape) for w in weights if w.group > 0]
    arena = PanelArena([tuple(w.panels.shape) for w in weights], dtype, scale_shapes)
    return [arena.place(w) for w in weights]


def unpack_panels(weight: PanelWeight) -> torch.Tensor:
    """The ``[N, K]`` float32 weight the panels stand for (dequantized for int8)."""
    panels = weight.panels
    p = panels.shape[0]
    if panels.dtype == torch.uint8:
        from kernels.int4_linear import unpack_int4_panels

        return unpack_int4_panels(weight)
    if panels.dtype == torch.int8:  # [P, K2, 32] -> [P, 16, K2, 2] -> [16P, 2 K2]
        dense = panels.view(p, -1, LANES, 2).permute(0, 2, 1, 3).reshape(p * LANES, -1).float()
        if weight.group > 0:  # scale [P, G, 16] float16 -> [16P, G] float32 (exact) -> one per k: [16P, K]
            per_k = weight.scale.float().transpose(1, 2).reshape(p * LANES, -1).repeat_interleave(weight.group, dim=1)
            dense = dense[:, : weight.in_k] * per_k
        else:
            dense = dense * weight.scale[:, None]
    else:
        dense = panels.transpose(1, 2).reshape(p * LANES, -1)
    return dense[: weight.out_features, : weight.in_k]


# Rows of x from which a product goes through torch's GEMM on a transient [N, K] float32
# copy of the weight (``unpack_panels``; int8 dequantized, x then not rounded to 16 bits)
# instead of the panel kernel, where the build's kernel is behind torch.mm on
# prefill-sized products. Decided on a 2-core Zen 3 (AVX2), bench-135m, a whole prefill
# step with the two paths alternated step by step in one process (the timings:
# benchmarks/NOTES.md):
# - float32, AVX2's hand-scheduled loop: the kernel is ahead at every row count, so no
#   threshold while K <= GEMM_MIN_K. The kernel does not block k, and past that it falls
#   behind on many rows (one product, N = 2048, 512 rows: level at K = 2048, behind at
#   K = 4096).
#   (The compiled loop before it was behind from 512 rows at every K.)
# - int8 on AVX2, since its tiles run dequantized through the float loop from 16 rows:
#   the kernel is ahead too, so the same rule. (The int8 loop before it was behind.)
# - AVX-512 builds (compiled loop): oneDNN / torch.mm level or ahead at 2048 rows on the
#   machines of earlier notes; portable builds: the compiled loop.
# The copy is one pass over the weight, small against the product it serves.
GEMM_MIN_ROWS = 512
GEMM_MIN_K = 2048


@functools.cache
def _kernel_isa() -> str:
    return torch.ops.tandem_cpu.panel_kernel_isa()


def gemm_min_rows(in_k: int) -> int | None:
    """Rows from which ``panel_linear`` hands a product of inner size ``in_k`` (float32 or
    int8 weights alike) to torch.mm for this build's kernel (None: never). Needs the
    native kernels."""
    if in_k <= GEMM_MIN_K and _kernel_isa() == "avx2":
        return None
    return GEMM_MIN_ROWS


def panel_linear(
    x: torch.Tensor,  # [M, K] float32
    weight: PanelWeight,
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    """``x @ W.T + bias`` natively (needs ``kernels.cpu_ops.native_available()``);
    products of at least ``gemm_min_rows`` rows through ``F.linear`` on the unpacked weight."""
    if _through_torch_mm(x, weight):
        return F.linear(x, unpack_panels(weight), None if bias is None else bias.float())
    x, out, bias_t = _kernel_operands(x, weight, bias)
    torch.ops.tandem_cpu.panel_linear(out, x, weight.panels, weight.scale, bias_t)
    return out


def _through_torch_mm(x: torch.Tensor, weight: PanelWeight) -> bool:
    if weight.panels.dtype == torch.uint8:  # 4-bit: the kernel at every size (kernels/int4_linear.py)
        return False
    threshold = gemm_min_rows(weight.in_k)
    return threshold is not None and x.shape[0] >= threshold


def _kernel_operands(
    x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x with unit column stride, an [M, N] float32 output, and the bias as the op takes
    it (empty: none)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    return x, out, torch.empty(0) if bias is None else bias.float().contiguous()


def panel_linear_argmax(
    x: torch.Tensor,  # [M, K] float32
    weight: PanelWeight,
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M] int64
    """``panel_linear(x, weight, bias).argmax(-1)`` (first column of each row's maximum),
    each tile of the product scanned right after the kernel wrote it."""
    if _through_torch_mm(x, weight):
        return panel_linear(x, weight, bias).argmax(dim=-1)
    x, out, bias_t = _kernel_operands(x, weight, bias)
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    torch.ops.tandem_cpu.panel_linear_argmax(out, tokens, x, weight.panels, weight.scale, bias_t)
    return tokens


# Greedy screen (``panel_linear_argmax_screened``). Rows up to which it pays (measured on a
# 2-core Zen 3, AVX2, on a 49152 x 576 LM head: benchmarks/NOTES.md): its gain shrinks as
# rows are added, since the int8 kernel's work grows with the rows and the float32 one's
# hardly does below a register block.
SCREEN_MAX_ROWS = 8
# Candidate tiles (32 columns each) past which a row takes the full float32 argmax: each
# costs little to recompute against what the screen saves on such a head.
SCREEN_MAX_TILES = 64


@dataclass(frozen=True)
class ArgmaxScreen:
    """A float32 panel weight with an int8 copy of it and the per-row error bounds that
    let ``panel_linear_argmax_screened`` prove which columns can hold a row's maximum."""

    exact: PanelWeight  # float32 panels, [N, K]
    screen: PanelWeight  # int8 panels of the same weight
    # [2, 16P] float32, rounded up, 2-norms over a row (w' = the int8 row times its scale,
    # eta = 2 (K + 16) 2^-24): U = |w - w'| + eta (|w| + |w'|), V = |w'| + eta (|w| + |w'|).
    bounds: torch.Tensor


def argmax_screen(weight: torch.Tensor, exact: PanelWeight, chunk_rows: int = 4096) -> ArgmaxScreen | None:
    """The screen of a dense ``[N, K]`` weight whose float32 panels are ``exact`` (None
    when the weight holds inf or NaN). Norms in float64, ``chunk_rows`` rows at a time."""
    n, k = weight.shape
    if exact.panels.dtype != torch.float32 or (exact.out_features, exact.in_k) != (n, k):
        raise ValueError(f"exact must be the float32 panels of the [{n}, {k}] weight")
    eta = 2.0 * (k + 16) * 2.0**-24
    bounds = torch.zeros(2, exact.panels.shape[0] * LANES, dtype=torch.float64)
    for r0 in range(0, n, chunk_rows):
        w = weight[r0 : r0 + chunk_rows].detach().double()
        q, scale = quantize_int8(weight[r0 : r0 + chunk_rows])
        wq = q.double() * scale.double()[:, None]
        norm_w, norm_q = w.norm(dim=1), wq.norm(dim=1)
        slack = eta * (norm_w + norm_q)
        bounds[0, r0 : r0 + len(w)] = (w - wq).norm(dim=1) + slack
        bounds[1, r0 : r0 + len(w)] = norm_q + slack
    if not bool(torch.isfinite(bounds).all()) or float(bounds.max()) > 1e15:
        return None
    up = torch.nextafter(bounds.float(), torch.tensor(float("inf")))
    return ArgmaxScreen(exact=exact, screen=pack_panels(weight, quantize=True), bounds=up.contiguous())


def panel_linear_argmax_screened(
    x: torch.Tensor,  # [M, K] float32
    screen: ArgmaxScreen,
) -> torch.Tensor:  # [M] int64
    """``panel_linear_argmax(x, screen.exact, None)``, found through the int8 screen for up
    to ``SCREEN_MAX_ROWS`` rows (more rows: the plain argmax)."""
    weight = screen.exact
    if x.shape[0] > SCREEN_MAX_ROWS or _through_torch_mm(x, weight):
        return panel_linear_argmax(x, weight, None)
    x, out, _ = _kernel_operands(x, weight, None)
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    torch.ops.tandem_cpu.panel_linear_argmax_screened(
        out, tokens, x, weight.panels, screen.screen.panels, screen.screen.scale, screen.bounds, SCREEN_MAX_TILES
    )
    return tokens


X_BLOCK = 256  # columns of x per 16-bit fixed-point block (int8 weights)


def round_x_16bit(x: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` float32 -> the values the int8 kernel multiplies: each row rounded to a
    step of 1/32767 of its largest |value| in every block of ``X_BLOCK`` columns."""
    m, k = x.shape
    blocks = -(-k // X_BLOCK)
    padded = F.pad(x.float(), (0, blocks * X_BLOCK - k)).view(m, blocks, X_BLOCK)
    step = padded.abs().amax(dim=2, keepdim=True) / 32767.0
    step = torch.where(step > 0, step, torch.ones_like(step))
    return (torch.round(padded / step) * step).view(m, -1)[:, :k]


@functools.cache
def _int8_float_rows() -> int:
    return torch.ops.tandem_cpu.panel_int8_float_rows()


def panel_linear_reference(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The same product through ``F.linear`` on the unpacked weight (and, for int8
    panels, on ``x`` rounded as the kernel rounds it: below the build's
    ``panel_int8_float_rows`` rows; 4-bit panels: ``int4_linear_reference``). Needs the
    native kernels."""
    if weight.panels.dtype == torch.uint8:
        from kernels.int4_linear import int4_linear_reference

        return int4_linear_reference(x, weight, bias)
    rounds_x = weight.panels.dtype == torch.int8 and x.shape[0] < _int8_float_rows()
    x = round_x_16bit(x) if rounds_x else x.float()
    return F.linear(x, unpack_panels(weight), None if bias is None else bias.float())
