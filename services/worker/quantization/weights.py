"""A quantized linear layer's weight as one form, whatever the checkpoint's: the products and the packing read
these, and each checkpoint layout is read into one of them (`layouts.py`).

`Int8Weight` is a W8A8 layer's: int8 weights with a scale per output channel, and its inputs' quantization.
`CodedWeight` is a weights-only layer's (W4A16, W8A16, FP8 W8A16): a code per weight whose value is
code x scale + offset, with a scale and an offset per output channel and group of inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.worker.quantization.schemes import QuantizationError
from services.worker.tensor_parallel import Shard


@dataclass(slots=True)
class Int8Weight:
    weight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]
    input_scale: float = 0.0  # one scale for every row of x (a static checkpoint's); 0: each row its own

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def sharded(self, shard: Shard, name: str) -> Int8Weight:
        if shard.parts != 1:
            raise QuantizationError(f"{name}: a weight split in several runs is not supported quantized")
        if shard.dim == 0:
            return replace(self, weight=_part(self.weight, 0, shard), scales=_part(self.scales, 0, shard))
        return replace(self, weight=_part(self.weight, 1, shard))

    @staticmethod
    def joined(parts: list[Int8Weight]) -> Int8Weight:
        """Projections of one input side by side (q, k and v): one static scale must serve them all, the largest
        (no value of x then clips that did not before)."""
        return Int8Weight(
            torch.cat([p.weight for p in parts]),
            torch.cat([p.scales for p in parts]),
            max(p.input_scale for p in parts),
        )

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scales[:, None]

    def to(self, device: torch.device) -> Int8Weight:
        return replace(self, weight=self.weight.to(device), scales=self.scales.to(device))


@dataclass(slots=True)
class CodedWeight:
    codes: torch.Tensor  # uint8 [N, K]: a 4-bit code, a byte, or an e4m3 number's bits (kind)
    scales: torch.Tensor  # float32 [N, K / group]
    offsets: torch.Tensor  # float32 [N, K / group]: the zero point, as -zero x scale
    kind: str  # "uint4", "uint8" or "fp8"
    order: torch.Tensor | None = None  # int64 [K]: the inputs in the order of K here (GPTQ's act order)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def group(self) -> int:
        return int(self.codes.shape[1] // self.scales.shape[1])

    def sharded(self, shard: Shard, name: str) -> CodedWeight:
        if shard.parts != 1:
            raise QuantizationError(f"{name}: a weight split in several runs is not supported quantized")
        if shard.dim == 0:
            return replace(
                self,
                codes=_part(self.codes, 0, shard),
                scales=_part(self.scales, 0, shard),
                offsets=_part(self.offsets, 0, shard),
            )
        if self.order is not None:
            raise QuantizationError(
                f"{name}: a checkpoint in act order (desc_act) cannot split its inputs among "
                "tensor-parallel ranks: its groups are spread over every input"
            )
        group = self.group
        if self.scales.shape[1] == 1:  # one group a channel: every rank has the whole scale
            return replace(self, codes=_part(self.codes, 1, shard))
        if shard.start % group or shard.size % group:
            raise QuantizationError(
                f"{name}: the groups of {group} inputs do not divide among the tensor-parallel "
                f"ranks ({shard.size} inputs each)"
            )
        groups = Shard(1, shard.start // group, shard.size // group)
        return replace(
            self,
            codes=_part(self.codes, 1, shard),
            scales=_part(self.scales, 1, groups),
            offsets=_part(self.offsets, 1, groups),
        )

    @staticmethod
    def joined(parts: list[CodedWeight], name: str) -> CodedWeight:
        """Projections of one input side by side (q, k and v; gate and up)."""
        first = parts[0]
        if any(p.kind != first.kind or p.group != first.group for p in parts):
            raise QuantizationError(f"{name}: projections of one input are quantized differently")
        orders = [p.order for p in parts]
        if any(
            (o is None) != (first.order is None) or (o is not None and not torch.equal(o, first.order)) for o in orders
        ):
            raise QuantizationError(f"{name}: projections of one input are in different act orders")
        return CodedWeight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.offsets for p in parts]),
            first.kind,
            first.order,
        )

    def to(self, device: torch.device) -> CodedWeight:
        return replace(
            self,
            codes=self.codes.to(device),
            scales=self.scales.to(device),
            offsets=self.offsets.to(device),
            order=None if self.order is None else self.order.to(device),
        )

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] in the checkpoint's order of inputs."""
        values = self.codes.view(torch.float8_e4m3fn).float() if self.kind == "fp8" else self.codes.float()
        group = self.group
        weight = values * self.scales.repeat_interleave(group, 1) + self.offsets.repeat_interleave(group, 1)
        if self.order is None:
            return weight
        restored = torch.empty_like(weight)
        restored[:, self.order] = weight
        return restored


def _part(tensor: torch.Tensor, dim: int, shard: Shard) -> torch.Tensor:
    return tensor.narrow(dim, shard.start, shard.size).contiguous()
