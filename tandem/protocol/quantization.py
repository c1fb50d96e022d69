"""A checkpoint's ``quantization_config`` (config.json), read into ``QuantizationConfig``.

Torch-free: the frontend reads configs too. What loads (the tensors themselves are
converted by ``engine_service/models/quant_formats.py``):

- ``gptq``: 4-bit, ``group_size`` 32/64/128/... or -1 (one group per row), ``desc_act``
  (act-order, ``g_idx``), ``sym`` or not; ``checkpoint_format`` (or GPTQModel's
  ``format``) ``gptq`` (v1: a stored zero point is the zero minus one) or ``gptq_v2``.
- ``awq``: 4-bit, ``zero_point`` true, ``version`` ``gemm`` (AutoAWQ's GEMM packing).
- ``compressed-tensors``: FP8 weights (``float8_e4m3fn`` with a float scale per tensor or
  per output channel; ``format`` ``float-quantized`` or ``naive-quantized``). Input
  activation schemes are accepted and ignored: the engine computes in float.

Anything else is refused with one line naming the field (``ModelLoadError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.protocol.model_families import ModelLoadError

# quant_method -> what it loads (docs/models.md's "Quantized checkpoints" table lists these).
SUPPORTED_METHODS: dict[str, str] = {
    "gptq": "4-bit GPTQ (v1 and v2 zero points, act-order)",
    "awq": "4-bit AWQ (GEMM packing)",
    "compressed-tensors": "FP8 weights (per-tensor or per-channel scales)",
}
GPTQ_FORMATS = ("gptq", "gptq_v2")
FP8_STRATEGIES = ("tensor", "channel")
_CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class QuantizationConfig:
    """How a checkpoint's linear layers are stored.

    ``group_size``: inputs per scale (GPTQ/AWQ), -1 for one group per row; 0 for FP8.
    ``zero_offset``: added to a stored zero point (GPTQ v1 stores zero - 1, so 1; else 0).
    ``strategy``: FP8 weight scales, ``tensor`` or ``channel``; "" otherwise.
    ``not_converted``: modules the config names as left in float (AWQ's
    ``modules_to_not_convert``, compressed-tensors' ``ignore``); their tensors are plain
    float in the checkpoint and load as such.
    """

    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int
    group_size: int = 0
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = ""  # gptq: gptq | gptq_v2; awq: gemm; compressed-tensors: its format
    strategy: str = ""
    input_activations: str | None = (
        None  # compressed-tensors: "dynamic", "static" or None (ignored)
    )
    not_converted: tuple[str, ...] = ()

    @property
    def zero_offset(self) -> int:
        return 1 if self.method == "gptq" and self.checkpoint_format == "gptq" else 0

    @property
    def is_int4(self) -> bool:
        return self.method in ("gptq", "awq")


def parse_quantization_config(raw: Any, source: str = "config.json") -> QuantizationConfig | None:
    """``config.json``'s ``quantization_config`` (None when absent) as a ``QuantizationConfig``;
    ``ModelLoadError`` naming the field for anything this engine cannot load."""
    if raw is None:
        return None
    fields = _Fields(raw, source)
    method = fields.get("quant_method", ...)
    if not isinstance(method, str):
        raise fields.error("quant_method", f"must be a string, got {method!r}")
    method = method.lower()
    if method == "gptq":
        return _gptq(fields)
    if method == "awq":
        return _awq(fields)
    if method == "compressed-tensors":
        return _compressed_tensors(fields)
    raise fields.error(
        "quant_method",
        f"{method!r} is not supported; supported: {', '.join(SUPPORTED_METHODS)} (docs/models.md)",
    )


def _gptq(fields: _Fields) -> QuantizationConfig:
    fields.four_bits("gptq")
    dynamic = fields.get("dynamic", None)
    if dynamic:
        raise fields.error("dynamic", "per-module overrides are not supported")
    fmt = fields.get("checkpoint_format", None) or fields.get("format", None) or "gptq"
    if not isinstance(fmt, str) or fmt.lower() not in GPTQ_FORMATS:
        key = "checkpoint_format" if fields.get("checkpoint_format", None) else "format"
        raise fields.error(key, f"{fmt!r} is not supported; supported: {', '.join(GPTQ_FORMATS)}")
    return QuantizationConfig(
        method="gptq",
        bits=4,
        group_size=fields.group_size(),
        desc_act=fields.boolean("desc_act", False),
        sym=fields.boolean("sym", True),
        checkpoint_format=fmt.lower(),
        not_converted=fields.names("modules_to_not_convert"),
    )


def _awq(fields: _Fields) -> QuantizationConfig:
    fields.four_bits("awq")
    version = fields.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise fields.error("version", f"{version!r} is not supported (only gemm)")
    if not fields.boolean("zero_point", True):
        raise fields.error("zero_point", "false is not supported (only zero_point true)")
    return QuantizationConfig(
        method="awq",
        bits=4,
        group_size=fields.group_size(),
        sym=False,
        checkpoint_format="gemm",
        not_converted=fields.names("modules_to_not_convert"),
    )


def _compressed_tensors(fields: _Fields) -> QuantizationConfig:
    fmt = fields.get("format", "float-quantized")
    if fmt not in _CT_FORMATS:
        raise fields.error(
            "format", f"{fmt!r} is not supported (only FP8 weights: {', '.join(_CT_FORMATS)})"
        )
    for key in ("kv_cache_scheme", "sparsity_config"):
        if fields.get(key, None):
            raise fields.error(key, "is not supported (must be null)")
    groups = fields.get("config_groups", ...)
    if not isinstance(groups, dict) or not groups:
        raise fields.error("config_groups", f"must be a non-empty object, got {groups!r}")
    strategies: set[str] = set()
    activations: set[str | None] = set()
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise fields.error(where, f"must be an object, got {group!r}")
        if group.get("format") not in (None, *_CT_FORMATS):
            raise fields.error(f"{where}.format", f"{group['format']!r} is not supported")
        strategies.add(_fp8_weights(fields, where, group.get("weights")))
        activations.add(_activations(fields, where, group.get("input_activations")))
        if group.get("output_activations"):
            raise fields.error(f"{where}.output_activations", "is not supported (must be null)")
    if len(strategies) > 1:
        raise fields.error(
            "config_groups", f"mixes weight strategies {sorted(strategies)}; one is supported"
        )
    activation = (
        "static" if "static" in activations else ("dynamic" if "dynamic" in activations else None)
    )
    return QuantizationConfig(
        method="compressed-tensors",
        bits=8,
        checkpoint_format=fmt,
        strategy=strategies.pop(),
        input_activations=activation,
        not_converted=fields.names("ignore"),
    )


def _fp8_weights(fields: _Fields, where: str, weights: Any) -> str:
    """A group's ``weights`` scheme -> its strategy (FP8 with a per-tensor or per-channel scale)."""
    where = f"{where}.weights"
    if not isinstance(weights, dict):
        raise fields.error(where, f"must be an object, got {weights!r}")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise fields.error(
            where,
            f"{weights.get('num_bits')!r}-bit {weights.get('type')!r} weights are not supported "
            "(only 8-bit float: FP8)",
        )
    strategy = weights.get("strategy")
    if strategy not in FP8_STRATEGIES:
        raise fields.error(
            f"{where}.strategy",
            f"{strategy!r} is not supported; supported: {', '.join(FP8_STRATEGIES)}",
        )
    if weights.get("symmetric") is False:
        raise fields.error(
            f"{where}.symmetric", "false is not supported (FP8 weights have no zero point)"
        )
    if weights.get("dynamic"):
        raise fields.error(f"{where}.dynamic", "true is not supported (weights need stored scales)")
    return str(strategy)


def _activations(fields: _Fields, where: str, scheme: Any) -> str | None:
    """A group's ``input_activations``: accepted and ignored (activations stay float)."""
    if scheme is None:
        return None
    if not isinstance(scheme, dict):
        raise fields.error(
            f"{where}.input_activations", f"must be an object or null, got {scheme!r}"
        )
    return "dynamic" if scheme.get("dynamic") else "static"


class _Fields:
    """Reads of ``quantization_config``'s fields with one-line errors naming the field."""

    def __init__(self, raw: Any, source: str) -> None:
        if not isinstance(raw, dict):
            raise _error(f"{source}: quantization_config must be an object, got {raw!r}")
        self.raw = raw
        self.source = source

    def get(self, name: str, default: Any) -> Any:
        value = self.raw.get(name, default)
        if value is ...:
            raise self.error(name, "is missing")
        return value

    def error(self, name: str, message: str) -> ValueError:
        return _error(f"{self.source}: quantization_config.{name} {message}")

    def four_bits(self, method: str) -> None:
        bits = self.get("bits", ...)
        if bits != 4 or isinstance(bits, bool):
            raise self.error("bits", f"{bits!r} is not supported for {method} (only 4)")

    def group_size(self) -> int:
        value = self.get("group_size", ...)
        if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value > 0):
            raise self.error("group_size", f"must be a positive integer or -1, got {value!r}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {value!r}")
        return value

    def names(self, name: str) -> tuple[str, ...]:
        value = self.get(name, None)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(name, f"must be a list of module names, got {value!r}")
        return tuple(value)


def _error(message: str) -> ValueError:
    return ModelLoadError(message)
