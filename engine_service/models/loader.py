"""Build a ``DecoderForCausalLM`` and fill it from a checkpoint: its ``*.safetensors``
files, or the GGUF file a GGUF sidecar names (read by gguf_weights.py).

Every checkpoint tensor maps onto a parameter, or onto a row range of a fused one
(checkpoint_map.py's ``weight_targets``). The loader checks that each target is written
exactly once, with the expected shape, and that nothing is left unwritten or unused.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from safetensors import safe_open

from engine_service.models.checkpoint_map import (
    WeightTarget,
    fused_checkpoint_parts,
    weight_targets,
)
from engine_service.models.decoder import DecoderForCausalLM
from engine_service.models.gguf_weights import gguf_entries
from engine_service.models.quant_formats import QuantizedTensors
from engine_service.models.quantized import Fp8Rows, Int4Rows, QuantizedRows
from kernels.dispatch import KernelOps
from tandem.gguf_metadata import read_pointer
from tandem.protocol.model_config import ModelConfig, ModelLoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

# Checkpoint tensors that carry no weights (old checkpoints stored rotary tables).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of ``model_dir``: the index's shards, or the single file."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index_path}: not a valid safetensors index ({e!r})") from e
        files = [os.path.join(model_dir, name) for name in dict.fromkeys(weight_map.values())]
    else:
        files = [os.path.join(model_dir, SAFETENSORS_SINGLE)]
        if not os.path.isfile(files[0]):
            found = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
            if not found:
                raise ModelLoadError(
                    f"no weights in {model_dir!r}: expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}"
                )
            files = [os.path.join(model_dir, n) for n in found]
    for path in files:
        if not os.path.isfile(path):
            raise ModelLoadError(f"missing weight file {path!r}")
    return files


class WeightLoader:
    """Copies checkpoint tensors into a model's parameters, tracking what was written."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        config: ModelConfig,
        targets: dict[str, WeightTarget] | None = None,
    ) -> None:
        """``targets``: default ``weight_targets(config)`` (the whole model)."""
        self._params = dict(model.named_parameters())
        self._targets = weight_targets(config) if targets is None else targets
        self._loaded_from: dict[str, str] = {}  # checkpoint tensor name -> file it came from
        # Parameter name -> (row_start, int8 rows with group scales) of each checkpoint tensor
        # read as stored (GGUF Q8_0): the model packs those rows as they are.
        self.int8_rows: dict[str, list[tuple[int, QuantizedRows]]] = {}
        # The same for 4-bit matrices (GGUF Q4_*, GPTQ, AWQ), in their common form.
        self.int4_rows: dict[str, list[tuple[int, Int4Rows]]] = {}
        # The same for FP8 matrices read as stored (``load_weights(keep_fp8=True)``).
        self.fp8_rows: dict[str, list[tuple[int, Fp8Rows]]] = {}
        # Some tied checkpoints also store a copy of the embedding as lm_head.weight.
        self._skip_lm_head = config.tie_word_embeddings
        self._fused = fused_checkpoint_parts(config)
        for name, target in self._targets.items():
            param = self._params.get(target.param)
            if param is None or target.row_start + target.num_rows > param.shape[0]:
                raise RuntimeError(f"internal: no room for {name} in parameter {target.param}")

    def load_file(self, path: str) -> None:
        """Load every tensor of one safetensors file."""
        with safe_open(path, framework="pt", device="cpu") as f:
            self.load_entries(path, safetensors_entries(f))

    def load_entries(self, source: str, entries: Iterable[tuple[str, tuple[int, ...], Reader]]) -> None:
        """Load ``(name, shape, read)`` triples from ``source`` (a file, for messages):
        ``read(take)`` returns the tensor, or only its ``take`` slice."""
        if self._fused:
            entries = _split_fused(entries, self._fused)
        for name, shape, read in entries:
            if _IGNORED.match(name) or (self._skip_lm_head and name == "lm_head.weight"):
                continue
            target = self._targets.get(name)
            if target is None:
                raise ModelLoadError(f"{source}: unexpected tensor {name!r} (no parameter takes it)")
            if name in self._loaded_from:
                raise ModelLoadError(
                    f"{source}: tensor {name!r} was already loaded from {self._loaded_from[name]}"
                )
            if shape != target.shape:
                raise ModelLoadError(
                    f"{source}: tensor {name!r} has shape {list(shape)}, expected {list(target.shape)}"
                )
            param = self._params[target.param]
            rows = param.data[target.row_start : target.row_start + target.num_rows]
            tensor = read(target.take)
            if isinstance(tensor, QuantizedRows):
                self.int8_rows.setdefault(target.param, []).append((target.row_start, tensor))
                tensor = tensor.dequantize()  # the dense copy: until packing drops it, and embeddings
            elif isinstance(tensor, Int4Rows):
                self.int4_rows.setdefault(target.param, []).append((target.row_start, tensor))
                tensor = tensor.dequantize()
            elif isinstance(tensor, Fp8Rows):
                self.fp8_rows.setdefault(target.param, []).append((target.row_start, tensor))
                tensor = tensor.dequantize()
            rows.copy_(tensor)  # casts to the parameter's dtype and device
            if target.offset:
                rows.add_(target.offset)
            self._loaded_from[name] = source

    def check_complete(self, model_dir: str) -> None:
        missing = [n for n in self._targets if n not in self._loaded_from]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"{model_dir}: checkpoint lacks tensors {shown}")


# read(take) -> the tensor, or its ``take`` slice ``(dim, start, stop)`` (None: all of it).
Reader = Callable[[tuple[int, int, int] | None], torch.Tensor]


def _split_fused(
    entries: Iterable[tuple[str, tuple[int, ...], Reader]], fused: dict[str, list[tuple[str, int, int]]]
) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """Fused tensors (``checkpoint_map.fused_checkpoint_parts``) as their separate parts;
    the fused tensor is read once for all of them."""
    for name, shape, read in entries:
        parts = fused.get(name)
        if parts is None:
            yield name, shape, read
            continue
        whole: list[Any] = []  # the fused tensor, read on first use

        def part_reader(start: int, rows: int, read: Reader = read, whole: list[Any] = whole) -> Reader:
            def read_part(take: tuple[int, int, int] | None) -> torch.Tensor:
                if not whole:
                    whole.append(read(None))
                tensor = whole[0]
                if isinstance(tensor, (QuantizedRows, Int4Rows, Fp8Rows)):
                    tensor = tensor.rows(torch.arange(start, start + rows))
                    if take is None or take[0] == 0:
                        return tensor if take is None else tensor.rows(torch.arange(take[1], take[2]))
                    tensor = tensor.dequantize()  # a column slice of a quantized part: as float
                else:
                    tensor = tensor[start : start + rows]
                if take is None:
                    return tensor
                dim, lo, hi = take
                return tensor[lo:hi] if dim == 0 else tensor[:, lo:hi]

            return read_part

        for part_name, start, rows in parts:
            yield part_name, (rows, *shape[1:]), part_reader(start, rows)


def safetensors_entries(f: Any) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """``(name, shape, read)`` for each tensor of an open safetensors file; a ``take`` slice
    is read without the rest of the tensor."""

    def reader(name: str) -> Reader:
        def read(take: tuple[int, int, int] | None) -> torch.Tensor:
            if take is None:
                return f.get_tensor(name)
            dim, start, stop = take
            part = f.get_slice(name)
            return part[start:stop] if dim == 0 else part[:, start:stop]

        return read

    for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
        yield name, tuple(f.get_slice(name).get_shape()), reader(name)


def gguf_reader_entries(
    path: str, config: ModelConfig, keep_int8: bool = False, keep_int4: bool = False
) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """A GGUF file's tensors as loader entries: dequantized to float, or with ``keep_int8``
    its Q8_0 / Q5_0 / Q6_K matrices as ``QuantizedRows``, with ``keep_int4`` its Q4_* / Q5_* ones
    as ``Int4Rows`` (whole tensors only)."""
    for name, shape, read in gguf_entries(path, config):
        yield name, shape, _taking(read, keep_int8, keep_int4)


def _taking(read: Callable[[bool, bool], Any], keep_int8: bool, keep_int4: bool = False) -> Reader:
    def read_take(take: tuple[int, int, int] | None) -> torch.Tensor:
        tensor = read(keep_int8 and take is None, keep_int4 and take is None)
        if take is None:
            return tensor
        dim, start, stop = take
        return tensor[start:stop] if dim == 0 else tensor[:, start:stop]

    return read_take


def load_weights(
    loader: WeightLoader,
    model_dir: str,
    config: ModelConfig,
    keep_int8: bool = False,
    keep_int4: bool = False,
    keep_fp8: bool = False,
) -> None:
    """Fill ``loader``'s model from ``model_dir``: its safetensors files, or the GGUF file its
    ``gguf.json`` names (a GGUF sidecar, see ``tandem.model_source``); then check nothing is
    missing. ``keep_int8``: GGUF Q8_0 matrices also land in ``loader.int8_rows``;
    ``keep_int4``: GGUF Q4_* / Q5_* ones in ``loader.int4_rows`` (taking Q5_0 from int8).
    ``keep_fp8``: FP8 checkpoint matrices in ``loader.fp8_rows``."""
    pointer = read_pointer(model_dir)
    with torch.no_grad():
        if pointer is not None:
            gguf_file = pointer["gguf_file"]
            if not os.path.isfile(gguf_file):
                raise ModelLoadError(f"{model_dir}: its GGUF file {gguf_file!r} is gone")
            loader.load_entries(gguf_file, gguf_reader_entries(gguf_file, config, keep_int8, keep_int4))
        elif config.quantization is not None:
            _load_quantized(loader, checkpoint_files(model_dir), config, keep_fp8)
        else:
            for path in checkpoint_files(model_dir):
                loader.load_file(path)
    loader.check_complete(model_dir)


def _load_quantized(loader: WeightLoader, files: list[str], config: ModelConfig, keep_fp8: bool = False) -> None:
    """A GPTQ, AWQ or FP8 checkpoint (quant_formats.py): float tensors load as they come,
    then each quantized layer's tensors, which may straddle files, as one ``<layer>.weight``
    (every file stays open until then)."""
    assert config.quantization is not None
    tensors = QuantizedTensors(config.quantization, wanted=weight_targets(config), keep_fp8=keep_fp8)
    with contextlib.ExitStack() as stack:
        for path in files:
            f = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            loader.load_entries(path, tensors.take(path, safetensors_entries(f)))
        for path, entry in tensors.rest():
            loader.load_entries(path, [entry])


def load_model(
    model_dir: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: KernelOps | None = None,
    keep_int8: bool = False,
    keep_int4: bool = False,
    keep_fp8: bool = False,
) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Build the model for ``model_dir`` in ``dtype`` on ``device``, weights loaded, eval mode.
    ``keep_int8``: the checkpoint's int8 matrices (GGUF Q8_0) are handed to the model as
    stored (``DecoderForCausalLM.int8_rows``), for ``pack_linears`` to pack as they are;
    ``keep_int4`` the same for its 4-bit ones (GGUF Q4_* / Q5_*: ``int4_rows``).
    ``keep_fp8``: FP8 checkpoint matrices also as stored (``fp8_rows``), for the CUDA kernel."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    if ops is None:
        from kernels.dispatch import get_ops

        ops = get_ops("torch")
    device = torch.device(device)
    config = ModelConfig.from_pretrained(model_dir)
    if read_pointer(model_dir) is None:
        checkpoint_files(model_dir)  # a missing weight file is named before memory is allocated
    model = DecoderForCausalLM(config, ops, dtype, device)
    loader = WeightLoader(model, config)
    load_weights(loader, model_dir, config, keep_int8, keep_int4, keep_fp8)
    model.int8_rows = loader.int8_rows
    model.int4_rows = loader.int4_rows
    model.fp8_rows = loader.fp8_rows
    return model.eval(), config
