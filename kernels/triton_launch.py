"""What every Triton op of ``kernels.triton_ops`` stands on: ``KernelLaunch`` (a planned
launch, also compilable for a GPU target without one), ``PlanCache`` (checked plans by
tensor layout), and the input checks the plans share.

Importing this module imports triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from triton.compiler import ASTSource

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_TRITON_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
}


@dataclass(frozen=True)
class KernelLaunch:
    """Everything needed to launch (or compile) one kernel.

    ``args`` holds the runtime arguments in the kernel's parameter order; ``constexprs``
    the compile-time constants that follow them.
    """

    kernel: Any  # triton JITFunction, or InterpretedFunction under TRITON_INTERPRET=1
    grid: tuple[int, ...]
    args: dict[str, Any]
    constexprs: dict[str, int | bool] = field(default_factory=dict)
    num_warps: int = 4

    def run(self) -> None:
        if any(n == 0 for n in self.grid):
            return
        self.kernel[self.grid](**self.args, **self.constexprs, num_warps=self.num_warps)

    def ast_source(self) -> ASTSource:
        """This launch as ``triton.compile`` input, specialised the way ``@triton.jit``
        specialises a real launch: integer arguments equal to 1 become constants, and
        tensors (device allocations are 16-byte aligned) and integers divisible by 16 are
        marked ``tt.divisibility=16``, which lets Triton vectorise loads."""
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        attrs: dict[tuple[int, ...], list[list[Any]]] = {}
        for index, (name, value) in enumerate(self.args.items()):
            if _is_int(value) and value == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = _triton_type(value)
            if isinstance(value, torch.Tensor) or (_is_int(value) and value % 16 == 0):
                attrs[(index,)] = [["tt.divisibility", 16]]
        signature.update({name: "constexpr" for name in self.constexprs})
        constexprs.update(self.constexprs)
        return ASTSource(fn=self.kernel, signature=signature, constexprs=constexprs, attrs=attrs)


class PlanCache:
    """Checked launches by the layout of their tensors (shape, strides, dtype, device)
    and their other arguments.

    The layers of a step call each op on tensors of one layout (their own weights and
    caches), so the checks and the plan of the first call hold for the rest: a hit only
    launches with the new tensors, and the checks are saved on every call after the first
    (x layers x steps). Entries keep no tensor; the cache is emptied at ``max_entries``."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        # key -> (kernel, grid, the non-tensor arguments, constexprs, num_warps)
        self._plans: dict[tuple[Any, ...], tuple[Any, tuple[int, ...], dict[str, Any], dict[str, Any], int]] = {}

    def launch(self, key: tuple[Any, ...], tensors: dict[str, torch.Tensor], plan: Any) -> None:
        """Run the cached plan of ``key`` on ``tensors`` (kernel argument name -> tensor),
        or ``plan()`` (which checks and returns a KernelLaunch over these tensors) first."""
        entry = self._plans.get(key)
        if entry is None:
            launch = plan()
            if len(self._plans) >= self.max_entries:
                self._plans.clear()
            static = {k: v for k, v in launch.args.items() if not isinstance(v, torch.Tensor)}
            entry = (launch.kernel, launch.grid, static, launch.constexprs, launch.num_warps)
            self._plans[key] = entry
        kernel, grid, static, constexprs, num_warps = entry
        if any(n == 0 for n in grid):
            return
        kernel[grid](**static, **tensors, **constexprs, num_warps=num_warps)


def layout(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What a plan depends on of a tensor: shape, strides, dtype, device."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


_PLANS = PlanCache()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _triton_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_DTYPE_NAMES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for kernel argument {value!r}")


def interpreting() -> bool:
    """True when triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _require_dim(t: torch.Tensor, ndim: int, name: str) -> None:
    _require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def _require_dtype(t: torch.Tensor, dtypes: tuple[torch.dtype, ...], name: str) -> None:
    _require(t.dtype in dtypes, f"{name} has dtype {t.dtype}; expected one of {dtypes}")


def _require_unit_last_stride(t: torch.Tensor, name: str) -> None:
    _require(t.shape[-1] <= 1 or t.stride(-1) == 1, f"{name} must be contiguous in its last dim")


def _require_launchable(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and a CUDA one unless the interpreter runs the kernels."""
    devices = {t.device for t in tensors}
    _require(len(devices) == 1, f"tensors are on different devices: {sorted(map(str, devices))}")
    device = next(iter(devices))
    _require(
        interpreting() or device.type == "cuda",
        f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 "
        "before importing triton to run them on CPU",
    )


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _require_dim(key_cache, 4, "key_cache")
    _require(
        key_cache.shape == value_cache.shape,
        f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ",
    )
    _require_dtype(key_cache, _FLOAT_DTYPES, "key_cache")
    _require_dtype(value_cache, _FLOAT_DTYPES, "value_cache")
    _require_unit_last_stride(key_cache, "key_cache")
    _require_unit_last_stride(value_cache, "value_cache")
