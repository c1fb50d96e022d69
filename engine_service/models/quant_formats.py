"""GPTQ, AWQ and compressed-tensors FP8 safetensors checkpoints, as the weight loader's entries.

A quantized linear layer is stored as several tensors under its module's name.
``QuantizedTensors`` gathers them (across files too: a shard may end between a layer's
tensors) and hands the loader ONE entry ``<layer>.weight`` with the float weight's shape
``[out, in]``, as a float checkpoint has it, so the loader's map and checks stay as they are:

- GPTQ (``qweight``, ``qzeros``, ``scales``, ``g_idx``) and AWQ (``qweight``, ``qzeros``,
  ``scales``): ``read`` returns ``Int4Rows`` (quantized.py), the one 4-bit form. The loader
  keeps it in ``int4_rows`` (for the 4-bit kernel) and fills the dense parameter with its
  dequantized values, so today these models run in float.
- compressed-tensors FP8 (``weight`` in float8_e4m3fn, ``weight_scale``; ``input_scale``
  is dropped: activations stay float): ``read`` returns ``weight.float() * weight_scale``,
  dequantized at load; with ``keep_fp8`` (the CUDA start-up asks for it) ``Fp8Rows``, the
  codes and scales as stored, which the loader keeps in ``fp8_rows`` beside the float copy.

Every other tensor (embeddings, norms, the LM head, biases, layers left in float) passes
through unchanged.

Layouts (N outputs, K inputs, ``group`` inputs per scale (-1: K), G = ceil(K / group);
"packed" = 8 unsigned 4-bit values per int32, value i in bits 4i..4i+3):

- GPTQ: ``qweight`` int32 ``[K/8, N]`` packed along the inputs (``qweight[i, n]`` holds
  inputs 8i..8i+7 of output n); ``qzeros`` int32 ``[G, N/8]`` packed along the outputs;
  ``scales`` float16 ``[G, N]``; ``g_idx`` int32 ``[K]``, each input's group.
  ``weight[n, k] = scales[g, n] * (q[k, n] - (z[g, n] + offset))``, ``g = g_idx[k]`` with
  act-order (``desc_act``), else ``k // group`` (``g_idx`` is then ignored, as vLLM does);
  ``offset`` is 1 for ``checkpoint_format`` gptq (v1 stores the zero point minus one), 0
  for gptq_v2.
- AWQ (GEMM): ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32 ``[G, N/8]``, both
  packed along the outputs in AutoAWQ's interleaved order (value i of word j is output
  ``8j + AWQ_PACK_ORDER[i]``); ``scales`` float16 ``[G, N]``;
  ``weight[n, k] = scales[k // group, n] * (q[k, n] - z[k // group, n])``.
- FP8: ``weight`` float8 ``[N, K]``; ``weight_scale`` float ``[1]`` (per tensor) or
  ``[N, 1]`` (per output channel); ``weight = weight.float() * weight_scale``.

In ``Int4Rows`` form: codes are ``q`` transposed to ``[N, K]``, scales ``[N, G]``, mins
``-scales * zeros``. Act-order: the inputs are sorted by group (stably) into ``perm``, so
that the sorted columns form equal groups in order. Where the stored groups cannot take
that form (K not a multiple of the group, act-order groups of unequal sizes), ``read``
returns the dequantized float weight instead.

Tensor-parallel slices (``read(take)``): rows (column-parallel q/k/v/gate/up) are
``Int4Rows.rows``; columns (row-parallel o/down) are the ``Int4Rows``' own columns when the
slice starts and ends on group boundaries and there is no ``perm``, else the dequantized
float columns (act-order, group -1, or a slice inside a group). Either way the whole
stored tensors are read and converted, then sliced (they hold 4 bits a weight).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine_service.models.quantized import Fp8Rows, Int4Rows
from tandem.protocol.model_config import ModelLoadError
from tandem.protocol.quantization import QuantizationConfig

Take = tuple[int, int, int] | None  # (dim, start, stop) of the float weight; None: all of it
Reader = Callable[[Take], Any]  # read(take) -> torch.Tensor or Int4Rows
Entry = tuple[str, tuple[int, ...], Reader]

# AutoAWQ's GEMM packing: value i (bits 4i..4i+3) of a word holds output AWQ_PACK_ORDER[i] of its 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNPACK = [AWQ_PACK_ORDER.index(j) for j in range(8)]  # output j of 8 is value _AWQ_UNPACK[j]

# Tensors a quantized layer is stored as, by method (the layer's float weight is not among them).
_GROUP_PARTS: dict[str, tuple[str, ...]] = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_scale", "input_scale"),
}


@dataclass(frozen=True)
class _Part:
    source: str  # the file, for messages
    shape: tuple[int, ...]
    read: Reader


def quantized_entries(
    entries: Iterable[Entry], quantization: QuantizationConfig, wanted: Container[str] | None = None
) -> Iterator[Entry]:
    """The loader entries of one stream of a quantized checkpoint's ``(name, shape, read)``
    triples: float tensors as they come, then one ``<layer>.weight`` per quantized layer."""
    tensors = QuantizedTensors(quantization, wanted)
    yield from tensors.take("", entries)
    for _, entry in tensors.rest():
        yield entry


class QuantizedTensors:
    """Gathers quantized layers' tensors over a checkpoint's files.

    ``take(source, entries)`` passes float tensors through and keeps the quantized parts;
    ``rest()`` then yields ``(source, entry)`` for each quantized layer, and the tensors
    held back until it was known whether a quantized layer claims them. ``wanted``: the
    names the model takes (``weight_targets``); a GPTQ/AWQ layer's bias that no parameter
    takes and that is all zeros is dropped (AutoGPTQ writes zero biases for bias-free
    layers), as vLLM does."""

    def __init__(
        self, quantization: QuantizationConfig, wanted: Container[str] | None = None,
        keep_fp8: bool = False,
    ) -> None:
        self.quantization = quantization
        self.wanted = wanted
        self.keep_fp8 = keep_fp8  # FP8 layers read as Fp8Rows (stored codes and scales)
        self._parts = _GROUP_PARTS[quantization.method]
        # FP8: a layer's weight is held until we know whether a weight_scale goes with it.
        self._held_part = "bias" if quantization.is_int4 else "weight"
        self._layers: dict[str, dict[str, _Part]] = {}  # layer prefix -> part name -> part
        self._held: dict[str, _Part] = {}  # full name -> part

    def take(self, source: str, entries: Iterable[Entry]) -> Iterator[Entry]:
        for name, shape, read in entries:
            prefix, _, part = name.rpartition(".")
            if part in self._parts:
                parts = self._layers.setdefault(prefix, {})
                self._check_new(name, parts.get(part), source)
                parts[part] = _Part(source, tuple(shape), read)
            elif self._holds(name, part, shape):
                self._check_new(name, self._held.get(name), source)
                self._held[name] = _Part(source, tuple(shape), read)
            else:
                yield name, shape, read

    def rest(self) -> Iterator[tuple[str, Entry]]:
        for prefix, parts in self._layers.items():
            if self.quantization.is_int4:
                yield self._int4_entry(prefix, parts)
            elif "weight_scale" in parts:
                yield self._fp8_entry(prefix, parts)
            else:  # an input_scale alone
                raise ModelLoadError(
                    f"{parts['input_scale'].source}: {prefix}.input_scale without {prefix}.weight_scale"
                )
        for name, part in self._held.items():
            prefix = name.rpartition(".")[0]
            if self.quantization.is_int4 and prefix in self._layers and not part.read(None).any():
                continue  # a zero bias of a bias-free quantized layer
            read = part.read if self.quantization.is_int4 else _not_fp8(name, part)
            yield part.source, (name, part.shape, read)

    def _holds(self, name: str, part: str, shape: tuple[int, ...]) -> bool:
        if part != self._held_part:
            return False
        if part == "weight":  # FP8: any matrix may have a weight_scale
            return len(shape) == 2
        return self.wanted is not None and name not in self.wanted  # a bias no parameter takes

    @staticmethod
    def _check_new(name: str, seen: _Part | None, source: str) -> None:
        if seen is not None:
            raise ModelLoadError(f"{source}: tensor {name!r} was already found in {seen.source}")

    def _int4_entry(self, prefix: str, parts: dict[str, _Part]) -> tuple[str, Entry]:
        q = self.quantization
        needed = ["qweight", "qzeros", "scales"] + (
            ["g_idx"] if q.method == "gptq" and q.desc_act else []
        )
        missing = [p for p in needed if p not in parts]
        if missing:
            source = next(iter(parts.values())).source
            raise ModelLoadError(
                f"{source}: quantized layer {prefix} lacks {', '.join(f'{prefix}.{p}' for p in missing)}"
            )
        qweight = parts["qweight"]
        rows, cols = _matrix_shape(prefix, qweight)
        n, k = (cols, rows * 8) if q.method == "gptq" else (cols * 8, rows)
        group = k if q.group_size == -1 else q.group_size
        groups = -(-k // group)
        expect = {"qzeros": (groups, n // 8), "scales": (groups, n)}
        if q.method == "gptq" and "g_idx" in parts:
            expect["g_idx"] = (k,)
        for part, shape in expect.items():
            if parts[part].shape != shape or n % 8:
                raise ModelLoadError(
                    f"{parts[part].source}: {prefix}.{part} has shape {list(parts[part].shape)}, expected "
                    f"{list(shape)} for a {q.method} layer of {n} outputs and {k} inputs in groups of {group}"
                )

        def convert() -> Int4Rows | torch.Tensor:
            qw, qz, sc = (parts[p].read(None) for p in ("qweight", "qzeros", "scales"))
            if q.method == "awq":
                return awq_weight(qw, qz, sc, group)
            g_idx = parts["g_idx"].read(None) if q.desc_act else None
            try:
                return gptq_weight(qw, qz, sc, group, g_idx, q.zero_offset)
            except ModelLoadError as e:
                raise ModelLoadError(f"{parts['g_idx'].source}: {prefix}.{e}") from None

        def read(take: Take) -> Int4Rows | torch.Tensor:
            return take_slice(convert(), take)

        return qweight.source, (f"{prefix}.weight", (n, k), read)

    def _fp8_entry(self, prefix: str, parts: dict[str, _Part]) -> tuple[str, Entry]:
        scale = parts["weight_scale"]
        weight = self._held.pop(f"{prefix}.weight", None)
        if weight is None:
            raise ModelLoadError(f"{scale.source}: {prefix}.weight_scale without {prefix}.weight")
        n, _ = _matrix_shape(prefix, weight)
        per_channel = scale.shape in ((n, 1), (n,)) and n > 1
        if not per_channel and scale.shape not in ((), (1,), (1, 1)):
            raise ModelLoadError(
                f"{scale.source}: {prefix}.weight_scale has shape {list(scale.shape)}, expected [1] "
                f"(per tensor) or [{n}, 1] (per channel)"
            )

        keep = self.keep_fp8

        def read(take: Take) -> torch.Tensor | Fp8Rows:
            s = scale.read(None).float()
            s = s.reshape(-1, 1) if per_channel else s.reshape(())
            if per_channel and take is not None and take[0] == 0:
                s = s[take[1] : take[2]]
            values = weight.read(take)
            if keep and values.dtype == torch.float8_e4m3fn:
                return Fp8Rows(values, s.contiguous() if per_channel else s.reshape(1))
            return fp8_weight(values, s)

        return weight.source, (f"{prefix}.weight", weight.shape, read)


def _not_fp8(name: str, part: _Part) -> Reader:
    """``part.read``, refusing an FP8 matrix that came without its ``weight_scale``."""

    def read(take: Take) -> torch.Tensor:
        tensor = part.read(take)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ModelLoadError(
                f"{part.source}: {name} is {str(tensor.dtype).removeprefix('torch.')} but there is "
                f"no {name.rpartition('.')[0]}.weight_scale"
            )
        return tensor

    return read


def _matrix_shape(prefix: str, part: _Part) -> tuple[int, int]:
    if len(part.shape) != 2:
        raise ModelLoadError(
            f"{part.source}: a tensor of {prefix} has shape {list(part.shape)}, expected a matrix"
        )
    return part.shape[0], part.shape[1]


# ---- conversions (each format's documented packing) ------------------------------------------


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., M]`` -> uint8 ``[..., M, 8]``: value i of each word, bits 4i..4i+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def gptq_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    g_idx: torch.Tensor | None = None,
    zero_offset: int = 1,
) -> Int4Rows | torch.Tensor:
    """A GPTQ layer as ``Int4Rows`` (float32 ``[N, K]`` where its groups cannot take that
    form). ``g_idx``: each input's group (act-order); None: input k is in group k // group.
    ``zero_offset``: 1 for GPTQ v1 checkpoints (stored zero = zero - 1), 0 for gptq_v2."""
    rows, n = qweight.shape
    q = unpack_int32(qweight).permute(0, 2, 1).reshape(rows * 8, n)  # [K, N]: inputs 8i+j
    zeros = unpack_int32(qzeros).reshape(qzeros.shape[0], n).to(torch.int32) + zero_offset  # [G, N]
    return _int4(q, zeros, scales.float(), group, g_idx)


def awq_weight(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
) -> Int4Rows | torch.Tensor:
    """An AWQ (GEMM) layer as ``Int4Rows`` (float32 ``[N, K]`` where K is not a multiple of ``group``)."""
    k, words = qweight.shape
    q = unpack_int32(qweight)[..., _AWQ_UNPACK].reshape(k, words * 8)  # [K, N]
    zeros = (
        unpack_int32(qzeros)[..., _AWQ_UNPACK].reshape(qzeros.shape[0], words * 8).to(torch.int32)
    )
    return _int4(q, zeros, scales.float(), group, None)


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 (or any float) ``weight`` times its per-tensor or ``[N, 1]`` per-channel scale, in float32."""
    return weight.float() * scale.float()


def _int4(
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    g_idx: torch.Tensor | None,
) -> Int4Rows | torch.Tensor:
    """``q`` uint8 ``[K, N]``, ``zeros`` int ``[G, N]``, ``scales`` float32 ``[G, N]``:
    weight ``[N, K]`` = ``scales[g(k), n] * (q[k, n] - zeros[g(k), n])``."""
    k, num_groups = q.shape[0], scales.shape[0]
    plain = torch.arange(k) // group
    groups = plain if g_idx is None else g_idx.to(torch.int64)
    if int(groups.min()) < 0 or int(groups.max()) >= num_groups:
        raise ModelLoadError(f"g_idx names groups outside [0, {num_groups})")
    perm = None if torch.equal(groups, plain) else torch.argsort(groups, stable=True)
    if k % group or k % 2 or (perm is not None and not torch.equal(groups[perm], plain)):
        # no Int4Rows form (a partial last group, act-order groups of unequal sizes): float
        return (scales[groups] * (q.float() - zeros[groups].float())).T.contiguous()
    codes = q.T if perm is None else q.T[:, perm]  # [N, K]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    s = scales.T.contiguous()
    mins = -(s * zeros.T.float())
    return Int4Rows(packed.contiguous(), s, mins.contiguous(), group, perm)


def take_slice(weight: Int4Rows | torch.Tensor, take: Take) -> Int4Rows | torch.Tensor:
    """``take`` of a converted weight: ``Int4Rows`` rows, ``Int4Rows`` columns on group
    boundaries (no ``perm``), else float columns."""
    if take is None:
        return weight
    dim, start, stop = take
    if isinstance(weight, torch.Tensor):
        return weight[start:stop] if dim == 0 else weight[:, start:stop]
    if dim == 0:
        return weight.rows(torch.arange(start, stop))
    g = weight.group
    if weight.perm is None and start % g == 0 and stop % g == 0 and g % 2 == 0:
        return Int4Rows(
            weight.codes[:, start // 2 : stop // 2].contiguous(),
            weight.scales[:, start // g : stop // g].contiguous(),
            weight.mins[:, start // g : stop // g].contiguous(),
            g,
        )
    return weight.dequantize()[:, start:stop].contiguous()
