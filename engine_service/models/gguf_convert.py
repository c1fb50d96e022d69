"""Rewrite a GGUF file's matrices in another tensor type, with the ``gguf`` package's writer.

``requantize_gguf(src, dst, "Q8_0")`` keeps every metadata key (config, tokenizer, chat
template) and every 1-D tensor as it is, and stores each matrix dequantized and then
quantized to the target type (``F32``, ``F16`` or ``Q8_0``). The benchmarks and tests use
it to make F32 and Q8_0 files of the default model's weights, so Tandem and llama.cpp run
the same weights in each format::

    python -m engine_service.models.gguf_convert SRC.gguf DST.gguf Q8_0
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

TARGET_TYPES = ("F32", "F16", "Q8_0")
_FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7}  # llama.cpp's general.file_type (LLAMA_FTYPE_*)


def requantize_gguf(src: str, dst: str, target: str) -> None:
    """Write ``src``'s metadata and tensors to ``dst`` with every matrix stored as ``target``."""
    import gguf

    if target not in TARGET_TYPES:
        raise ValueError(f"target must be one of {TARGET_TYPES}, got {target!r}")
    qtype = gguf.GGMLQuantizationType[target]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = f"{dst}.tmp-{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        value = _FILE_TYPES[target] if name == "general.file_type" else field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # torch order
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if values.ndim < 2:
            writer.add_tensor(tensor.name, values)  # norms stay float32, as llama.cpp keeps them
            continue
        stored = gguf.quants.quantize(values, qtype)
        writer.add_tensor(tensor.name, stored, raw_shape=stored.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("target", choices=TARGET_TYPES)
    args = p.parse_args(argv)
    requantize_gguf(args.src, args.dst, args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
