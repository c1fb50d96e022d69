"""CPU linear layers through oneDNN with weights reordered once at load time.

``F.linear`` on CPU goes to the BLAS torch was built with (MKL). On this project's AMD
EPYC test machine oneDNN's matmul on a weight reordered into its blocked layout ran well
ahead of MKL's fp32 GEMM at every batch size from 8 to 2048 rows (``benchmarks/NOTES.md``
has the figures). The reorder is done once: the packed weight is an opaque ``mkldnn``
tensor that only ``packed_linear`` reads.

The first call with a new number of rows builds a oneDNN primitive; oneDNN keeps it in
its primitive cache afterwards, so only the first call of a shape pays for it.

oneDNN's bf16 path needs the ISA for it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT on x86):
``cpu_supports`` asks torch the same question ``mkldnn_reorder_linear_weight`` asks
before it refuses, so callers fall back to ``F.linear`` instead of failing there.
"""

from __future__ import annotations

import torch

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU runs oneDNN's linear in ``dtype`` (float32 everywhere; bfloat16
    only with the ISA torch's own check asks for)."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return probe is not None and bool(probe())
    return False


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``pack_weight`` / ``packed_linear`` work for this device and dtype."""
    return (
        device.type == "cpu"
        and dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and cpu_supports(dtype)
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[out_features, in_features]`` dense weight -> opaque oneDNN-layout copy."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(
    x: torch.Tensor,  # [m, in_features]
    packed_weight: torch.Tensor,  # from pack_weight
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [m, out_features]
    """``x @ weight.T + bias`` with the packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
