"""How a linear layer computes x W^T + b: a method per kind of weight (float, W8A8 int8, weights as codes),
each owning its prepared weight and its kernels. The models never name a kernel: they call their `Linear` layers
(services/worker/models/linear.py), and each layer asks its method.

A method's life: the loader reads the checkpoint into it (`FloatMethod` through the layer's `weight` parameter, a
quantized one from the tensors of `layouts.py`, split for this tensor-parallel rank), projections of one input are
joined (`joined`), and once loaded it is `prepare`d for the device (packed into the compiled kernels' panels on a
CPU). Then `apply` runs the product. A layer whose kernel cannot run here (no compiler, a GPU) computes with
torch from the dequantized weight, the same numbers at the precision of a float product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels import cpu_int8_linear, cpu_linear, dispatch, quant_triton
from kernels.cpu_linear import every_kernel_thread, linear
from kernels.workspace import step_scratch
from services.worker.quantization.schemes import QuantizationError
from services.worker.quantization.weights import CodedWeight, Int8Weight

if TYPE_CHECKING:
    from services.worker.models.linear import Linear


class LinearMethod:
    """The float method's defaults; a quantized method overrides what differs."""

    name = "float"

    def to(self, device: torch.device) -> None:
        """Its weight moved to `device` (as loaded, before `prepare`)."""

    def prepare(self, layer: Linear, dtype: torch.dtype) -> None:
        """Once its weight is loaded and joined: ready it for the device the weight is on, in a model served in
        `dtype` (float32: x's rows stay float32; bfloat16: a product may take them rounded to bfloat16)."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def gated(self, layer: Linear, x: torch.Tensor, bf16_rows: bool) -> torch.Tensor | None:
        """SiLU(gate) * up of a fused gate and up projection, the activation applied as the kernel stores its
        sums; None where this method has no such kernel (the caller applies the activation apart)."""
        return None

    def takes_bf16_rows(self, layer: Linear) -> bool:
        """Whether the product takes bfloat16 rows of x, which the kernel before it may then write."""
        return False

    def int8_rows(self, layer: Linear) -> cpu_int8_linear.Int8RowsFormat | None:
        """How the product takes x's rows already quantized to int8 (`cpu_int8_linear.Int8Rows`), which the kernel
        before it may then write in one pass; None where it takes float rows only."""
        return None

    def describe(self) -> str:
        """The kernel that runs, for the worker's log and info metric."""
        return self.name


class FloatMethod(LinearMethod):
    """Float weights (float32, bfloat16, float16): on a CPU the packed panels of `cpu_gemm.c`, and, where the CPU
    has AMX tiles for bfloat16, oneDNN for a prompt's bfloat16 products (`cpu_linear.prompt_products`)."""

    def __init__(self) -> None:
        self.panels: torch.Tensor | None = None

    def prepare(self, layer: Linear, dtype: torch.dtype) -> None:
        weight, bias = layer.weight, layer.bias
        if (
            weight.device.type == "cpu"
            and cpu_linear.packs(weight.dtype)
            and (bias is None or (bias.is_contiguous() and bias.dtype is torch.float32))
        ):
            self.panels = cpu_linear.pack(weight.detach(), halves=layer.halves)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.panels is not None and x.dim() == 2:
            out = step_scratch.take_if_large(
                layer.output_slot, (x.shape[0], layer.out_features), torch.float32, x.device
            )
            if self._prompt_by_onednn(layer, x):
                with every_kernel_thread():
                    out.copy_(F.linear(x.to(torch.bfloat16), layer.weight))
                return out if bias is None else out.add_(bias)
            if cpu_linear.gemm(x, self.panels, layer.out_features, bias, out=out, halves=layer.halves) is not None:
                return out
        if x.dtype is torch.bfloat16 and layer.weight.dtype is not torch.bfloat16:
            x = x.float()
        return linear(x, layer.weight, bias)

    def _prompt_by_onednn(self, layer: Linear, x: torch.Tensor) -> bool:
        panels = self.panels
        return (
            panels is not None
            and panels.dtype is torch.bfloat16
            and x.shape[0] >= cpu_linear.PROMPT_ROWS
            and layer.weight.dtype is torch.bfloat16
            and cpu_linear.prompt_products() == "onednn"
        )

    def gated(self, layer: Linear, x: torch.Tensor, bf16_rows: bool) -> torch.Tensor | None:
        if self.panels is None or not layer.halves or x.dim() != 2 or self._prompt_by_onednn(layer, x):
            return None
        shape, dtype = (x.shape[0], layer.halves), torch.bfloat16 if bf16_rows else torch.float32
        return cpu_linear.gated_gemm(
            x,
            self.panels,
            layer.halves,
            layer.bias,
            step_scratch.take_if_large("activation rows", shape, dtype, x.device),
        )

    def takes_bf16_rows(self, layer: Linear) -> bool:
        panels = self.panels
        if panels is None or panels.dtype is not torch.bfloat16 or layer.in_features % 2:
            return False
        build = cpu_linear.gemm_build()
        return build is not None and build.bf16_rows

    def describe(self) -> str:
        return (
            f"float ({str(self.panels.dtype).removeprefix('torch.')} panels)"
            if self.panels is not None
            else "float (torch)"
        )


class Int8Method(LinearMethod):
    """W8A8: int8 weights per output channel, x quantized to int8 per token (or by the checkpoint's static scale)
    by the norm or activation before the product (`int8_rows`) or as the product starts, the sums in int32
    (`cpu_int8_gemm.c`, in AMX tiles from 16 rows where the CPU has them: the same sums)."""

    name = "W8A8-int8"

    def __init__(self, weight: Int8Weight) -> None:
        self.weight = weight
        self.packed: cpu_int8_linear.Int8Panels | None = None
        self.by_triton = False  # a GPU's (or Triton chosen): the int8 sums in a Triton kernel
        self.dense: torch.Tensor | None = None  # the weight as floats, where no compiled kernel runs
        self.rows_format: cpu_int8_linear.Int8RowsFormat | None = None  # how the packed kernel takes quantized rows

    def to(self, device: torch.device) -> None:
        self.weight = self.weight.to(device)

    def prepare(self, layer: Linear, dtype: torch.dtype) -> None:
        weight = self.weight.weight
        self.weight.scales = self.weight.scales.float().contiguous()
        if dispatch.use_triton(weight):
            self.by_triton = True
            self.weight.weight = weight.contiguous()
        elif weight.device.type == "cpu" and cpu_int8_linear.int8_build() is not None:
            self.packed = cpu_int8_linear.pack_int8(weight)
            self.rows_format = cpu_int8_linear.rows_format(self.weight.input_scale)
        else:
            self.dense = weight.float()

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.by_triton:
            shape = x.shape
            out = quant_triton.int8_linear_gpu(
                x.reshape(-1, shape[-1]), self.weight.weight, self.weight.scales, bias, self.weight.input_scale
            )
            return out.reshape(*shape[:-1], -1).to(x.dtype)
        quantized = isinstance(x, cpu_int8_linear.Int8Rows)
        if self.packed is not None and (quantized or x.dim() == 2):
            rows = x if quantized or (x.dtype is torch.float32 and x.stride(1) == 1) else x.float().contiguous()
            out = step_scratch.take_if_large(
                layer.output_slot,
                (x.shape[0], layer.out_features),
                torch.float32,
                x.codes.device if quantized else x.device,
            )
            weight = self.weight
            if cpu_int8_linear.int8_linear(rows, self.packed, weight.scales, bias, weight.input_scale, out) is not None:
                return out
        if quantized:  # the same codes' sums, in torch
            codes = x.codes[:, : layer.in_features]
            unsigned = self.rows_format is not None and self.rows_format.unsigned
            codes = codes.view(torch.uint8).float() - 128.0 if unsigned else codes.float()
            return cpu_int8_linear.scale_sums(codes @ self._dense().T, x.scales, self.weight.scales, bias)
        return self._in_torch(x, bias)

    def int8_rows(self, layer: Linear) -> cpu_int8_linear.Int8RowsFormat | None:
        return self.rows_format

    def _dense(self) -> torch.Tensor:
        return self.dense if self.dense is not None else self.weight.weight.float()

    def _in_torch(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x quantized as the kernel quantizes it, and its sums as floats (exact while they stay below 2^24)."""
        rows = x.reshape(-1, x.shape[-1]).float()
        codes, scales = cpu_int8_linear.quantize_rows_reference(rows, self.weight.input_scale)
        out = cpu_int8_linear.scale_sums(codes.float() @ self._dense().T, scales, self.weight.scales, bias)
        return out.reshape(*x.shape[:-1], -1)

    def describe(self) -> str:
        build = cpu_int8_linear.int8_build()
        kernel = (
            f"int8 {build.variant} ({build.description})"
            if self.packed is not None and build
            else "Triton int8 sums"
            if self.by_triton
            else "torch"
        )
        return f"{self.name}, {'static' if self.weight.input_scale else 'dynamic per-token'} activations: {kernel}"


class CodedMethod(LinearMethod):
    """Weights as codes by groups of inputs (W4A16, W8A16, FP8 W8A16), x as it is: on a CPU `cpu_gemm.c`'s
    `gemm_codes`, which streams only the codes for a decode's rows and unpacks them in registers."""

    def __init__(self, weight: CodedWeight) -> None:
        self.weight = weight
        self.packed: cpu_linear.CodePanels | None = None
        self.gpu: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # quant_triton's words, scales, offsets
        self.dense: torch.Tensor | None = None
        self.bf16_x = False  # x's rows rounded to bfloat16 (a bfloat16 model's, where the build takes them)

    def to(self, device: torch.device) -> None:
        self.weight = self.weight.to(device)

    @property
    def name(self) -> str:  # type: ignore[override]
        bits = {"uint4": "W4A16", "uint8": "W8A16", "fp8": "FP8-W8A16"}[self.weight.kind]
        return f"{bits}, group {self.weight.group}" if self.weight.scales.shape[1] > 1 else f"{bits}, per channel"

    def prepare(self, layer: Linear, dtype: torch.dtype) -> None:
        weight = self.weight
        build = cpu_linear.gemm_build()
        self.bf16_x = dtype is torch.bfloat16 and build is not None and build.bf16_rows and weight.order is None
        k = weight.codes.shape[1]
        if (
            dispatch.use_triton(weight.codes)
            and k % quant_triton.BLOCK_K == 0
            and weight.group % quant_triton.BLOCK_K == 0
        ):
            self.gpu = quant_triton.pack_codes_gpu(weight.codes, weight.scales, weight.offsets, weight.kind)
        elif weight.codes.device.type == "cpu" and build is not None:
            self.packed = cpu_linear.pack_codes(
                weight.codes, weight.scales.float(), weight.offsets.float(), weight.kind
            )
        else:
            dtype = layer.bias.dtype if layer.bias is not None else torch.float32
            self.dense = weight.dequantized().to(device=weight.codes.device, dtype=dtype)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        order = self.weight.order
        if self.gpu is not None:
            flat = x.reshape(-1, x.shape[-1])
            rows = flat if order is None else flat[:, order]
            out = quant_triton.codes_gemm_triton(rows.contiguous(), *self.gpu, self.weight.kind, bias)
            return out.reshape(*x.shape[:-1], -1)
        if self.packed is not None and x.dim() == 2:
            rows = x if order is None else x[:, order]
            out = step_scratch.take_if_large(
                layer.output_slot, (x.shape[0], layer.out_features), torch.float32, x.device
            )
            if x.shape[0] >= cpu_linear.PROMPT_ROWS and self._prompts_by_onednn() and self._by_onednn(rows, bias, out):
                return out
            if cpu_linear.gemm_codes(rows, self.packed, bias, out, bf16_x=self.bf16_x) is not None:
                return out
        dense = self.dense if self.dense is not None else self.weight.dequantized()
        if x.dtype is torch.bfloat16 and dense.dtype is not torch.bfloat16:
            x = x.float()
        return linear(x, dense, bias)

    def _prompts_by_onednn(self) -> bool:
        return self.packed is not None and self.bf16_x and cpu_linear.code_prompt_products() == "onednn"

    def _by_onednn(self, rows: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> bool:
        """A prompt's product in AMX tiles: the weight unpacked once into bfloat16 values, as the packed kernel's
        prompt panels hold them, and multiplied by oneDNN through torch."""
        packed = self.packed
        assert packed is not None
        weight = step_scratch.take_if_large(
            "codes as bfloat16", (packed.out_features, packed.in_features), torch.bfloat16, rows.device
        )
        if cpu_linear.codes_as_bf16(packed, weight) is None:
            return False
        with every_kernel_thread():
            out.copy_(F.linear(rows.to(torch.bfloat16), weight))
        if bias is not None:
            out.add_(bias)
        return True

    def takes_bf16_rows(self, layer: Linear) -> bool:
        return self.packed is not None and self.bf16_x and layer.in_features % 2 == 0

    def describe(self) -> str:
        build = cpu_linear.gemm_build()
        kernel = (
            f"codes {build.variant} ({build.description})"
            if self.packed is not None and build
            else "triton"
            if self.gpu is not None
            else "torch"
        )
        rows = "bfloat16" if self.bf16_x else "float32"
        prompts = (
            f"; prompts of {cpu_linear.PROMPT_ROWS} rows or more unpacked to bfloat16 for oneDNN (AMX tiles)"
            if self._prompts_by_onednn()
            else "; prompts' panels unpacked once into AMX tiles"
            if self.packed is not None and self.bf16_x and cpu_linear.code_tiles_on()
            else ""
        )
        return f"{self.name}: {kernel}, {rows} rows of x{prompts}"


def quantized_method(weight: Int8Weight | CodedWeight) -> LinearMethod:
    return Int8Method(weight) if isinstance(weight, Int8Weight) else CodedMethod(weight)


def joined(methods: list[LinearMethod]) -> LinearMethod:
    """The method of projections of one input side by side (q, k and v; gate and up), all quantized alike."""
    if all(isinstance(m, Int8Method) for m in methods):
        return Int8Method(Int8Weight.joined([m.weight for m in methods]))  # type: ignore[attr-defined]
    if all(isinstance(m, CodedMethod) for m in methods):
        return CodedMethod(CodedWeight.joined([m.weight for m in methods], "a fused projection"))  # type: ignore[attr-defined]
    raise QuantizationError(
        "projections of one input (q, k and v; gate and up) must be quantized alike, found "
        f"{', '.join(m.name for m in methods)}"
    )
