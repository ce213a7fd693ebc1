"""A checkpoint's quantization, read from its config.json's `quantization_config` (or named by `--quantization`):
which linear layers are quantized, and in which scheme. Anything this module cannot serve is refused here, before a
weight is read, with a message that names the format and the field.

Formats: compressed-tensors (`int-quantized`, `naive-quantized`, `pack-quantized`, `float-quantized`), GPTQ (the
auto-gptq / gptqmodel layout, `desc_act` or not, v1 or v2 zero points) and AWQ (its GEMM layout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
# vLLM's names for the same checkpoints served by other kernels
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "marlin": "gptq", "compressed_tensors": "compressed-tensors"}
CT_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized", "float-quantized")


class QuantizationError(ValueError):
    """A quantization this server does not serve, or a checkpoint that contradicts its own."""


@dataclass(frozen=True, slots=True)
class Scheme:
    """How one linear layer's weight is stored and what its product quantizes.

    layout: where its tensors come from: "ct-int" (int8 `weight`), "ct-packed" (`weight_packed`), "ct-float" (FP8
    `weight`), "gptq" or "awq". group_size 0: one scale per output channel; block: FP8's (rows, columns) blocks.
    activations: "dynamic" (int8 per token) or "static" (int8, the checkpoint's per-tensor `input_scale`) for a
    W8A8 product, None for weights alone (W4A16, W8A16, FP8 W8A16)."""

    layout: str
    bits: int
    group_size: int = 0
    symmetric: bool = True
    activations: str | None = None
    block: tuple[int, int] | None = None
    act_order: bool = False
    zeros_plus_one: bool = False  # GPTQ's v1 checkpoints store each zero point less one

    @property
    def name(self) -> str:
        """What the log and the info metric call it: W8A8-int8, W4A16, W8A16 or FP8-W8A16, and the layout."""
        if self.activations is not None:
            return f"W8A8-int8 ({self.activations} activations)"
        kind = "FP8-W8A16" if self.layout == "ct-float" else f"W{self.bits}A16"
        group = (
            f"block {self.block[0]}x{self.block[1]}"
            if self.block
            else (f"group {self.group_size}" if self.group_size else "per channel")
        )
        return f"{kind} ({self.layout}, {group}{'' if self.symmetric else ', asymmetric'})"


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """A checkpoint's quantization: each group of targets with its scheme, and the layers left as they are."""

    method: str
    groups: tuple[tuple[tuple[str, ...], Scheme], ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(self, module: str) -> Scheme | None:
        """The scheme of the linear layer named `module` (as in the checkpoint), None for a float one."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(target == "Linear" or _matches(target, module) for target in targets):
                return scheme
        return None

    def describe(self) -> str:
        schemes = sorted({scheme.name for _, scheme in self.groups})
        return f"{self.method}: {', '.join(schemes)}"


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def read_quantization(declared: dict[str, Any] | None, flag: str | None) -> QuantizationConfig | None:
    """The quantization of a checkpoint whose config.json declares `declared` (its `quantization_config`), served
    with `--quantization flag`: None for a float checkpoint served as such."""
    flag = ALIASES.get(flag, flag) if flag else None
    if flag is not None and flag not in METHODS:
        raise QuantizationError(f"--quantization {flag!r} is not supported; supported: {', '.join(METHODS)}")
    if declared is None:
        if flag is not None:
            raise QuantizationError(
                f"--quantization {flag}: the checkpoint's config.json has no quantization_config "
                "(its weights are not quantized)"
            )
        return None
    if not isinstance(declared, dict):
        raise QuantizationError("config.json's quantization_config is not an object")
    method = str(declared.get("quant_method"))
    method = ALIASES.get(method, method)
    if method not in METHODS:
        raise QuantizationError(
            f"quantization method {method!r} (config.json quantization_config.quant_method) is "
            f"not supported; supported: {', '.join(METHODS)}"
        )
    if flag is not None and flag != method:
        raise QuantizationError(
            f"--quantization {flag} does not match the checkpoint's quantization_config.quant_method {method!r}"
        )
    read = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq, "fp8": _fp8}[method]
    return read(declared)


def _field(config: dict[str, Any], name: str, where: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    value = config.get(name, default)
    if value is not None and not isinstance(value, types):
        raise QuantizationError(f"{where}.{name} is {value!r}, which is not a {getattr(types, '__name__', types)}")
    return value


def _bits(value: object, where: str, allowed: tuple[int, ...]) -> int:
    if value not in allowed:
        raise QuantizationError(f"{where} is {value!r}: {' or '.join(map(str, allowed))} bits are supported")
    return int(str(value))


def _group_size(value: object, where: str) -> int:
    """A group size: -1 or None for one group per output channel (0 here)."""
    if value in (None, -1):
        return 0
    if type(value) is not int or value <= 0:
        raise QuantizationError(f"{where} is {value!r}: a positive group size, or -1 for one group a channel")
    return value


def _gptq(config: dict[str, Any]) -> QuantizationConfig:
    where = "quantization_config"
    bits = _bits(config.get("bits"), f"{where}.bits", (4, 8))
    group = _group_size(config.get("group_size", 128), f"{where}.group_size")
    desc_act = bool(_field(config, "desc_act", where, bool, False))
    symmetric = bool(_field(config, "sym", where, bool, True))
    checkpoint_format = _field(config, "checkpoint_format", where, str, "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"{where}.checkpoint_format is {checkpoint_format!r}: gptq or gptq_v2 are supported")
    scheme = Scheme("gptq", bits, group, symmetric, act_order=desc_act, zeros_plus_one=checkpoint_format == "gptq")
    ignore = tuple(_field(config, "modules_to_not_convert", where, list, []) or ())
    return QuantizationConfig("gptq", ((("Linear",), scheme),), ("lm_head", *ignore))


def _awq(config: dict[str, Any]) -> QuantizationConfig:
    where = "quantization_config"
    bits = _bits(config.get("bits", config.get("w_bit")), f"{where}.bits", (4,))
    group = _group_size(config.get("group_size", config.get("q_group_size", 128)), f"{where}.group_size")
    if group == 0:
        raise QuantizationError(f"{where}.group_size: AWQ checkpoints are quantized in groups")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(f"{where}.version is {version!r}: the GEMM layout is supported")
    if not config.get("zero_point", True):
        raise QuantizationError(f"{where}.zero_point is false: AWQ checkpoints with zero points are supported")
    ignore = tuple(_field(config, "modules_to_not_convert", where, list, []) or ())
    return QuantizationConfig(
        "awq", ((("Linear",), Scheme("awq", bits, group, symmetric=False)),), ("lm_head", *ignore)
    )


def _fp8(config: dict[str, Any]) -> QuantizationConfig:
    """vLLM's own FP8 checkpoints: e4m3 weights with `weight_scale_inv` by blocks, or `weight_scale` per tensor."""
    where = "quantization_config"
    block = _field(config, "weight_block_size", where, list)
    if block is not None and (len(block) != 2 or any(type(b) is not int or b <= 0 for b in block)):
        raise QuantizationError(f"{where}.weight_block_size is {block!r}: two positive integers")
    scheme = Scheme("fp8", 8, block=(block[0], block[1]) if block else None)
    ignore = tuple(_field(config, "ignored_layers", where, list, []) or ())
    return QuantizationConfig("fp8", ((("Linear",), scheme),), ("lm_head", *ignore))


def _compressed_tensors(config: dict[str, Any]) -> QuantizationConfig:
    where = "quantization_config"
    groups_raw = _field(config, "config_groups", where, dict)
    if not groups_raw:
        raise QuantizationError(f"{where}.config_groups is missing: no layer says how it is quantized")
    default_format = _field(config, "format", where, str)
    groups = []
    for name, group in groups_raw.items():
        here = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise QuantizationError(f"{here} is not an object")
        targets = _field(group, "targets", here, list)
        if not targets or not all(isinstance(t, str) for t in targets):
            raise QuantizationError(f"{here}.targets must list module names or classes")
        fmt = _field(group, "format", here, str) or default_format
        groups.append((tuple(targets), _ct_scheme(group, fmt, here)))
    ignore = _field(config, "ignore", where, list, []) or []
    return QuantizationConfig("compressed-tensors", tuple(groups), tuple(str(i) for i in ignore))


def _ct_scheme(group: dict[str, Any], fmt: object, here: str) -> Scheme:
    if fmt not in CT_FORMATS:
        raise QuantizationError(
            f"{here}.format is {fmt!r}; supported compressed-tensors formats: {', '.join(CT_FORMATS)}"
        )
    weights = _field(group, "weights", here, dict)
    if not weights:
        raise QuantizationError(f"{here}.weights is missing")
    wh = f"{here}.weights"
    kind = _field(weights, "type", wh, str, "int")
    strategy = _field(weights, "strategy", wh, str, "tensor")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise QuantizationError(f"{wh}.strategy is {strategy!r}: tensor, channel, group or block are supported")
    if weights.get("dynamic"):
        raise QuantizationError(f"{wh}.dynamic is true: weights quantized on the fly are not a checkpoint format")
    symmetric = bool(_field(weights, "symmetric", wh, bool, True))
    group_size = _group_size(weights.get("group_size"), f"{wh}.group_size") if strategy == "group" else 0
    if strategy == "group" and group_size == 0:
        raise QuantizationError(f"{wh}.group_size is missing for strategy group")
    act_order = weights.get("actorder") not in (None, False, "static")
    inputs = _field(group, "input_activations", here, dict)
    if fmt == "float-quantized":
        if kind != "float" or weights.get("num_bits") != 8:
            raise QuantizationError(f"{wh}: float-quantized takes 8-bit float weights (type float, num_bits 8)")
        block = None
        if strategy == "block":
            shape = weights.get("block_structure")
            if not (isinstance(shape, list) and len(shape) == 2 and all(type(b) is int and b > 0 for b in shape)):
                raise QuantizationError(f"{wh}.block_structure is {shape!r}: two positive integers")
            block = (shape[0], shape[1])
        # FP8 activations (W8A8-FP8) run on a CPU as weights-only: the inputs stay in the compute dtype.
        return Scheme("ct-float", 8, group_size, symmetric=True, block=block)
    if kind != "int":
        raise QuantizationError(f"{wh}.type is {kind!r}: {fmt} takes integer weights")
    if strategy == "block":
        raise QuantizationError(f"{wh}.strategy block is for FP8 weights (float-quantized)")
    if fmt == "pack-quantized":
        bits = _bits(weights.get("num_bits"), f"{wh}.num_bits", (4, 8))
        if inputs is not None:
            raise QuantizationError(
                f"{here}.input_activations: pack-quantized weights with quantized activations are not supported"
            )
        return Scheme("ct-packed", bits, group_size, symmetric, act_order=act_order)
    bits = _bits(weights.get("num_bits"), f"{wh}.num_bits", (8,))
    if inputs is None:
        return Scheme("ct-int", bits, group_size, symmetric, act_order=act_order)
    ih = f"{here}.input_activations"
    if _field(inputs, "type", ih, str, "int") != "int" or inputs.get("num_bits") != 8:
        raise QuantizationError(f"{ih}: int8 activations are supported (type int, num_bits 8)")
    if not _field(inputs, "symmetric", ih, bool, True):
        raise QuantizationError(f"{ih}.symmetric is false: asymmetric activations are not supported")
    dynamic = bool(inputs.get("dynamic", False))
    activation_strategy = inputs.get("strategy", "token" if dynamic else "tensor")
    if (dynamic and activation_strategy != "token") or (not dynamic and activation_strategy != "tensor"):
        raise QuantizationError(
            f"{ih}: dynamic per-token or static per-tensor activations are supported, not "
            f"{'dynamic' if dynamic else 'static'} per {activation_strategy}"
        )
    if group_size or not symmetric:
        raise QuantizationError(f"{wh}: W8A8 takes symmetric weights per channel or per tensor")
    return Scheme("ct-int", 8, 0, True, activations="dynamic" if dynamic else "static")
