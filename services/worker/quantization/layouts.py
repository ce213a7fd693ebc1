"""Each checkpoint layout's tensors of one linear layer, read into the one form the products take
(`weights.py`), checked against each other and against what config.json implies on the way.

compressed-tensors packs codes along the inputs (`weight_packed` [N, K / 8] for 4 bits, each int32 word eight
codes of consecutive inputs, low bits first, stored as code + 8); GPTQ along the inputs too but transposed
(`qweight` [K / 8, N]), zero points packed along the outputs (`qzeros`, less one in its v1 checkpoints) and, in
act order, a group per input (`g_idx`); AWQ along the outputs (`qweight` [K, N / 8]) in the interleaved order
0, 2, 4, 6, 1, 3, 5, 7 of its GEMM kernel.
"""

from __future__ import annotations

import torch

from services.worker.quantization.schemes import QuantizationError, Scheme
from services.worker.quantization.weights import CodedWeight, Int8Weight

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output of each nibble of an AWQ word, by its place in the word
EXPECTED = {  # each layout's tensors of a layer: required, and optional
    "ct-int": ({"weight", "weight_scale"}, {"weight_zero_point", "input_scale", "input_zero_point", "weight_g_idx"}),
    "ct-packed": ({"weight_packed", "weight_scale"}, {"weight_shape", "weight_zero_point", "weight_g_idx"}),
    "ct-float": ({"weight", "weight_scale"}, {"input_scale"}),
    "fp8": ({"weight"}, {"weight_scale", "weight_scale_inv", "input_scale"}),
    "gptq": ({"qweight", "qzeros", "scales"}, {"g_idx"}),
    "awq": ({"qweight", "qzeros", "scales"}, set()),
}


def read_layer(scheme: Scheme, tensors: dict[str, torch.Tensor], name: str) -> Int8Weight | CodedWeight:
    """Layer `name`'s whole weight (before any tensor-parallel split) from its checkpoint tensors, by their names
    after the layer's (`weight_scale`, `qweight`, ...)."""
    required, optional = EXPECTED[scheme.layout]
    missing, unexpected = sorted(required - set(tensors)), sorted(set(tensors) - required - optional)
    if missing or unexpected:
        raise QuantizationError(
            f"{name} ({scheme.name}): the checkpoint lacks {missing or 'nothing'} and has "
            f"unexpected {unexpected or 'nothing'}"
        )
    read = {"ct-int": _ct_int, "ct-packed": _ct_packed, "ct-float": _ct_float, "fp8": _fp8, "gptq": _gptq, "awq": _awq}[
        scheme.layout
    ]
    return read(scheme, tensors, name)


def _check(condition: bool, name: str, what: str) -> None:
    if not condition:
        raise QuantizationError(f"{name}: {what}")


def _groups(scheme: Scheme, inputs: int, name: str) -> int:
    """The number of groups of inputs, once the group size is known to divide them."""
    if not scheme.group_size:
        return 1
    _check(
        inputs % scheme.group_size == 0,
        name,
        f"the group size {scheme.group_size} does not divide the input width {inputs}",
    )
    return inputs // scheme.group_size


def _scales_by_channel(scale: torch.Tensor, outputs: int, groups: int, name: str, what: str) -> torch.Tensor:
    """A scale per tensor ([] or [1]), per output ([N] or [N, 1]) or per output and group ([N, G]), as [N, G]."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(outputs, groups).contiguous()
    if scale.dim() == 1:
        scale = scale[:, None]
    _check(
        scale.dim() == 2 and scale.shape[0] == outputs and scale.shape[1] in (1, groups),
        name,
        f"{what} has shape {tuple(scale.shape)}; {outputs} x {groups} was expected",
    )
    return scale.expand(outputs, groups).contiguous()


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 / bits codes each, low bits first, as uint8 codes, the codes of a word side by side
    along `dim`."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    words = words.to(torch.int32)
    if dim == 0:
        codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return codes.reshape(-1, words.shape[1]).to(torch.uint8)
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return codes.reshape(words.shape[0], -1).to(torch.uint8)


def _act_order(weight: CodedWeight, g_idx: torch.Tensor | None, group: int, name: str) -> CodedWeight:
    """A weight whose inputs belong to groups by `g_idx` (act order), with its inputs sorted by group so that each
    group is a run of `group`, and the order kept for x."""
    if g_idx is None:
        return weight
    inputs = weight.codes.shape[1]
    g_idx = g_idx.to(torch.int64)
    _check(g_idx.shape == (inputs,), name, f"g_idx has shape {tuple(g_idx.shape)}; {inputs} inputs were expected")
    natural = torch.arange(inputs) // group
    if torch.equal(g_idx, natural):
        return weight
    order = torch.sort(g_idx, stable=True).indices
    _check(torch.equal(g_idx[order], natural), name, f"g_idx does not put {group} inputs in each group")
    weight.codes, weight.order = weight.codes[:, order].contiguous(), order
    return weight


def _ct_int(scheme: Scheme, t: dict[str, torch.Tensor], name: str) -> Int8Weight | CodedWeight:
    weight = t["weight"]
    _check(
        weight.dtype is torch.int8 and weight.dim() == 2,
        name,
        f"weight is {weight.dtype} {tuple(weight.shape)}; int8 [outputs, inputs] was expected",
    )
    outputs, inputs = weight.shape
    groups = _groups(scheme, inputs, name)
    scales = _scales_by_channel(t["weight_scale"], outputs, groups, name, "weight_scale")
    if scheme.activations is not None:
        _check("input_zero_point" not in t, name, "asymmetric activations (input_zero_point) are not supported")
        static = 0.0
        if scheme.activations == "static":
            _check(
                "input_scale" in t and t["input_scale"].numel() == 1, name, "static activations need one input_scale"
            )
            static = float(t["input_scale"].float().reshape(()))
            _check(static > 0, name, f"input_scale is {static}")
        return Int8Weight(weight, scales[:, 0].contiguous(), static)
    zero = (
        _scales_by_channel(t["weight_zero_point"], outputs, groups, name, "weight_zero_point")
        if "weight_zero_point" in t
        else torch.zeros(outputs, groups)
    )
    codes = (weight.to(torch.int16) + 128).to(torch.uint8)
    coded = CodedWeight(codes, scales, -(128 + zero) * scales, "uint8")
    return _act_order(coded, t.get("weight_g_idx"), scheme.group_size or inputs, name)


def _ct_packed(scheme: Scheme, t: dict[str, torch.Tensor], name: str) -> Int8Weight | CodedWeight:
    packed, bits = t["weight_packed"], scheme.bits
    _check(packed.dtype is torch.int32 and packed.dim() == 2, name, "weight_packed is not int32 [outputs, words]")
    per_word = 32 // bits
    outputs, inputs = packed.shape[0], packed.shape[1] * per_word
    if "weight_shape" in t:
        declared = tuple(int(v) for v in t["weight_shape"].reshape(-1).tolist())
        _check(len(declared) == 2, name, f"weight_shape is {declared}")
        outputs, inputs = declared
    _check(inputs % per_word == 0, name, f"{inputs} inputs do not fill whole words of {per_word} codes")
    _check(
        tuple(packed.shape) == (outputs, inputs // per_word),
        name,
        f"weight_packed has shape {tuple(packed.shape)}; {outputs} x {inputs // per_word} was expected",
    )
    groups = _groups(scheme, inputs, name)
    codes = _unpack(packed, bits, 1)
    scales = _scales_by_channel(t["weight_scale"], outputs, groups, name, "weight_scale")
    middle = 1 << (bits - 1)  # codes are stored as value + middle
    if scheme.symmetric:
        zero = torch.full((outputs, groups), float(middle))
    else:
        _check("weight_zero_point" in t, name, "an asymmetric scheme needs weight_zero_point")
        points = t["weight_zero_point"]
        _check(
            points.dtype is torch.int32 and points.dim() == 2 and points.shape[1] == groups,
            name,
            f"weight_zero_point has shape {tuple(points.shape)}",
        )
        zero = _unpack(points, bits, 0)[:outputs].float()
        _check(zero.shape == (outputs, groups), name, f"weight_zero_point holds {tuple(zero.shape)} zero points")
    coded = CodedWeight(codes, scales, -zero * scales, "uint4" if bits == 4 else "uint8")
    return _act_order(coded, t.get("weight_g_idx"), scheme.group_size or inputs, name)


def _fp8_codes(weight: torch.Tensor, name: str) -> torch.Tensor:
    _check(
        weight.dtype is torch.float8_e4m3fn and weight.dim() == 2,
        name,
        f"weight is {weight.dtype}; float8_e4m3fn [outputs, inputs] was expected",
    )
    return weight.view(torch.uint8)


def _block_scales(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int], name: str) -> torch.Tensor:
    """FP8 scales by blocks of (rows, columns), as a scale per output and group of `block[1]` inputs."""
    outputs, inputs = shape
    rows, columns = block
    _check(inputs % columns == 0, name, f"the block width {columns} does not divide the input width {inputs}")
    expected = (-(-outputs // rows), inputs // columns)
    _check(
        tuple(scale.shape) == expected,
        name,
        f"its block scales have shape {tuple(scale.shape)}; {expected} was expected",
    )
    return scale.float().repeat_interleave(rows, 0)[:outputs].contiguous()


def _ct_float(scheme: Scheme, t: dict[str, torch.Tensor], name: str) -> Int8Weight | CodedWeight:
    codes = _fp8_codes(t["weight"], name)
    outputs, inputs = codes.shape
    if scheme.block is not None:
        scales = _block_scales(t["weight_scale"], scheme.block, (outputs, inputs), name)
    else:
        scales = _scales_by_channel(t["weight_scale"], outputs, _groups(scheme, inputs, name), name, "weight_scale")
    return CodedWeight(codes, scales, torch.zeros_like(scales), "fp8")


def _fp8(scheme: Scheme, t: dict[str, torch.Tensor], name: str) -> Int8Weight | CodedWeight:
    codes = _fp8_codes(t["weight"], name)
    if scheme.block is not None:
        _check("weight_scale_inv" in t, name, "block-quantized FP8 needs weight_scale_inv")
        scales = _block_scales(t["weight_scale_inv"], scheme.block, (codes.shape[0], codes.shape[1]), name)
    else:
        _check("weight_scale" in t, name, "FP8 weights need weight_scale")
        scales = _scales_by_channel(t["weight_scale"], codes.shape[0], 1, name, "weight_scale")
    return CodedWeight(codes, scales, torch.zeros_like(scales), "fp8")


def _gptq(scheme: Scheme, t: dict[str, torch.Tensor], name: str) -> Int8Weight | CodedWeight:
    bits = scheme.bits
    per_word = 32 // bits
    _check(t["qweight"].dim() == 2, name, "qweight is not [inputs / codes a word, outputs]")
    inputs, outputs = t["qweight"].shape[0] * per_word, t["qweight"].shape[1]
    _check(
        inputs % per_word == 0 and outputs % per_word == 0,
        name,
        f"{outputs} x {inputs} does not fill whole words of {per_word} codes",
    )
    groups = _groups(scheme, inputs, name)
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    _check(
        tuple(qweight.shape) == (inputs // per_word, outputs),
        name,
        f"qweight has shape {tuple(qweight.shape)}; {inputs // per_word} x {outputs} was expected",
    )
    _check(
        tuple(qzeros.shape) == (groups, outputs // per_word),
        name,
        f"qzeros has shape {tuple(qzeros.shape)}; {groups} x {outputs // per_word} was expected",
    )
    _check(
        tuple(scales.shape) == (groups, outputs),
        name,
        f"scales has shape {tuple(scales.shape)}; {groups} x {outputs} was expected",
    )
    codes = _unpack(qweight, bits, 0).T.contiguous()
    zero = _unpack(qzeros, bits, 1).float().T + (1 if scheme.zeros_plus_one else 0)
    scale = scales.float().T.contiguous()
    coded = CodedWeight(codes, scale, (-zero * scale).contiguous(), "uint4" if bits == 4 else "uint8")
    return _act_order(coded, t.get("g_idx") if scheme.group_size else None, scheme.group_size or inputs, name)


def _awq(scheme: Scheme, t: dict[str, torch.Tensor], name: str) -> Int8Weight | CodedWeight:
    _check(t["qweight"].dim() == 2, name, "qweight is not [inputs, outputs / 8]")
    inputs, outputs = t["qweight"].shape[0], t["qweight"].shape[1] * 8
    _check(outputs % 8 == 0, name, f"{outputs} outputs do not fill whole words of 8 codes")
    groups = _groups(scheme, inputs, name)
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    _check(
        tuple(qweight.shape) == (inputs, outputs // 8),
        name,
        f"qweight has shape {tuple(qweight.shape)}; {inputs} x {outputs // 8} was expected",
    )
    _check(
        tuple(qzeros.shape) == (groups, outputs // 8),
        name,
        f"qzeros has shape {tuple(qzeros.shape)}; {groups} x {outputs // 8} was expected",
    )
    _check(
        tuple(scales.shape) == (groups, outputs),
        name,
        f"scales has shape {tuple(scales.shape)}; {groups} x {outputs} was expected",
    )

    def by_output(words: torch.Tensor) -> torch.Tensor:
        nibbles = _unpack(words, 4, 1).view(words.shape[0], -1, 8)
        ordered = torch.empty_like(nibbles)
        ordered[:, :, AWQ_ORDER] = nibbles
        return ordered.view(words.shape[0], -1)

    codes = by_output(qweight).T.contiguous()
    zero = by_output(qzeros).float().T
    scale = scales.float().T.contiguous()
    return CodedWeight(codes, scale, (-zero * scale).contiguous(), "uint4")
