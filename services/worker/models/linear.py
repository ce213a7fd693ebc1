"""A model's linear layer, y = x W^T + b, on every device and for every kind of weight: the layer keeps what the
model sees (its widths, its bias, where its output goes) and its method (services/worker/quantization) keeps the
weight as prepared and computes the product.

A layer starts as `nn.Linear` with a float `weight`, so a float checkpoint loads into it as into `nn.Linear`; the
loader gives a quantized layer its quantized method instead, and its `weight` is then None."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels.cpu_int8_linear import Int8Rows, Int8RowsFormat
from services.worker.quantization.methods import FloatMethod, LinearMethod


class Linear(nn.Linear):
    halves = 0  # a gated MLP's fused gate and up projection: each half's width, its panels packed in pairs (gated)
    # Where a model's use of this layer's output ends before the next layer of the same role runs
    # (within one decoder layer), a large output is written into a buffer of that name, reused
    # (kernels/workspace.py); None: a fresh tensor, for outputs that live on (the logits).
    output_slot: str | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs: Any) -> None:
        super().__init__(in_features, out_features, bias, **kwargs)
        self.method: LinearMethod = FloatMethod()

    def use(self, method: LinearMethod) -> None:
        """This layer's weight is `method`'s (a quantized one's), no longer the float parameter."""
        self.method = method
        self.register_parameter("weight", None)

    def prepare(self, dtype: torch.dtype) -> None:
        """Once loaded (and fused): the method readies its weight for the device (packs it for a CPU kernel), in
        a model served in `dtype`."""
        self.method.prepare(self, dtype)

    def forward(self, x: torch.Tensor | Int8Rows) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T`, plus `bias` where given (the row-parallel projections of tensor parallelism add
        theirs after the all-reduce)."""
        return self.method.apply(self, x, bias)

    def gated(self, x: torch.Tensor, bf16_rows: bool) -> torch.Tensor | None:
        """SiLU(gate) * up of this fused gate and up projection (`halves` set), the activation applied as the
        kernel stores its sums: float32 rows, or bfloat16 rows for a product that takes them. None where the
        kernel does not run here (then `forward`, and the activation apart)."""
        return self.method.gated(self, x, bf16_rows)

    @property
    def takes_bf16_rows(self) -> bool:
        """Whether this layer's kernel multiplies bfloat16 rows of x: its input may be written as such
        by the kernel before it (norm, activation), saving a pass that rounds float32 rows."""
        return self.method.takes_bf16_rows(self)

    @property
    def int8_rows(self) -> Int8RowsFormat | None:
        """How this layer's kernel takes x's rows already quantized to int8 (a W8A8 product's): its input may be
        written as such by the kernel before it (norm, activation), saving a pass and the product's own; None
        where it takes float rows."""
        return self.method.int8_rows(self)

    @property
    def panels(self) -> torch.Tensor | None:
        """A float weight's packed panels, where the CPU kernel runs it."""
        return getattr(self.method, "panels", None)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method.name}"


def prepare_layers(model: nn.Module, dtype: torch.dtype) -> None:
    """Every `Linear` of `model`, served in `dtype`, readied for its device by its method."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepare(dtype)
