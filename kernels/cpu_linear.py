"""Linear layers on a CPU: the packed kernels of `cpu_gemm.c`, where torch's own are slow (its BLAS on
AMD CPUs, and any bfloat16 or float16 weight on a CPU without their instructions; docs/kernels.md).

Weights are packed into panels when the model loads (`pack`), in the layout of the build that runs
(`GemmBuild`: its panel width, and whether bfloat16 weights meet bfloat16 rows of x in the AVX512-BF16
dot product or float32 rows converted in registers). x and y are float32 in every format, so only the
weights' bytes change with the dtype. A call's panels are shared by the threads (`native.share_units`).

`Linear` is `nn.Linear` with that dispatch: the models build their projections from it, so a
checkpoint loads into it as into `nn.Linear`. Its `weight` stays as loaded; the panels are a
second copy of it, made only where a kernel runs.

On a CPU with AMX tiles for bfloat16 a prompt's product of bfloat16 weights (PROMPT_ROWS rows or more)
goes to oneDNN through torch, which multiplies in those tiles; the packed kernel keeps a decode's few
rows, which reading the weights bounds (`prompt_products`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native
from kernels.workspace import step_scratch

SPLIT_MACS = 1 << 21  # below this many multiply-adds a call is not worth sharing between threads
SPLIT_ROWS = 4  # nor below this many rows, where reading the weight bounds it, unless the weight is larger
SPLIT_BYTES = 4 << 20  # than this: then a second core reads it faster (docs/kernels.md)
CHUNKS_PER_THREAD = 8  # a shared call's panels come in this many chunks per thread, claimed in turn
SYMBOLS = {torch.float32: "gemm_f32", torch.float16: "gemm_f16", torch.bfloat16: "gemm_bf16"}
ACT_NONE, ACT_SILU_F32, ACT_SILU_BF16 = 0, 1, 2  # what a call stores (cpu_gemm.c's enum activation)
PROMPT_ROWS = 64  # rows from which a bfloat16 product is bound by arithmetic, not by reading the weight
PROMPT_PRODUCTS = "PAGEDSERVE_PROMPT_PRODUCTS"  # "onednn" or "native": forces who multiplies a prompt's rows


@dataclass(frozen=True, slots=True)
class GemmBuild:
    """One build of cpu_gemm.c: its kernel per weight dtype and what packing and calling them needs."""

    kernels: dict[torch.dtype, object]
    panel_width: int
    bf16_rows: bool  # bfloat16 weights take x rounded to bfloat16 (the dot product), not float32
    description: str
    variant: str


@functools.cache
def gemm_build(variant: str | None = None) -> GemmBuild | None:
    """The build that runs here (or `variant`'s), None where none loads."""
    p, i = native.POINTER, native.INT64
    arguments = [p, i, p, p, p, i, i, i, i, i, i, i, p, i]
    kernels = {dtype: native.function("cpu_gemm", symbol, arguments, i, variant=variant)
               for dtype, symbol in SYMBOLS.items()}
    facts = {name: native.function("cpu_gemm", f"gemm_{name}", [], i, variant=variant)
             for name in ("panel_width", "bf16_reads_bf16_rows")}
    if None in facts.values() or None in kernels.values():
        return None
    library = native.load("cpu_gemm", variant)
    library.gemm_description.restype = native.ctypes.c_char_p
    width, bf16_rows = (fact() for fact in facts.values())
    return GemmBuild(kernels, width, bool(bf16_rows), library.gemm_description().decode(), native.variant_of(library))


@functools.cache
def prompt_products() -> str:
    """Who multiplies a prompt's rows (PROMPT_ROWS or more) by bfloat16 weights: "onednn" (torch's bfloat16
    product) where the CPU has AMX tiles for bfloat16, whose multiply rate is several times the dot product's,
    else "native" (cpu_gemm.c); PAGEDSERVE_PROMPT_PRODUCTS forces one."""
    forced = os.environ.get(PROMPT_PRODUCTS, "")
    if forced in ("onednn", "native"):
        return forced
    has_tiles = "amx_bf16" in native.cpu_flags() and torch.backends.mkldnn.is_available()
    return "onednn" if has_tiles else "native"


@contextlib.contextmanager
def every_kernel_thread() -> Iterator[None]:
    """Within, torch's operations get as many threads as the compiled kernels (one per core), which the
    worker gives torch only while other processes leave the cores idle (services/worker/cpu_threads.py)."""
    kept = torch.get_num_threads()
    if kept != native.threads():
        torch.set_num_threads(native.threads())
    try:
        yield
    finally:
        if kept != torch.get_num_threads():
            torch.set_num_threads(kept)


def describe_products(dtype: torch.dtype) -> str:
    """What the worker's log and info metric add to the build's description for weights of `dtype`."""
    if dtype is torch.bfloat16 and prompt_products() == "onednn":
        return f"; bfloat16 products of {PROMPT_ROWS} rows or more by oneDNN (AMX tiles where present)"
    return ""


def packs(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` run in a compiled kernel here."""
    return dtype in SYMBOLS and gemm_build() is not None


def pack(weight: torch.Tensor, build: GemmBuild | None = None, halves: int = 0) -> torch.Tensor:
    """`weight` [N, K] as panels of the build's width: [panels, K, width] for float32 and float16 (row k
    of panel p holds W[width p .. width p + width - 1][k]); for bfloat16 [panels, ceil(K / 2), width, 2],
    each column's k and k + 1 side by side (cpu_gemm.c). With `halves` (a gated MLP's gate rows, then as
    many up rows), the panels come in pairs: the gate panel of some columns, then the up panel of the same."""
    build = build or gemm_build()
    width = build.panel_width
    if halves:
        count, k = -(-halves // width), weight.shape[1]
        gate, up = torch.zeros(2, count * width, k, dtype=weight.dtype)
        gate[:halves], up[:halves] = weight.split(halves)
        weight = torch.stack([gate.view(count, width, k), up.view(count, width, k)], 1).view(-1, k)
    n, k = weight.shape
    panels = -(-n // width)
    pairs = weight.dtype is torch.bfloat16
    padded = torch.zeros(panels * width, k + (k % 2 if pairs else 0), dtype=weight.dtype)
    padded[:n, :k] = weight
    columns = padded.view(panels, width, -1).transpose(1, 2)  # [panels, K, width]
    if pairs:
        return columns.reshape(panels, -1, 2, width).transpose(2, 3).contiguous()
    return columns.contiguous()


def gemm(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None,
         build: GemmBuild | None = None, out: torch.Tensor | None = None, halves: int = 0) -> torch.Tensor | None:
    """`x W^T + b` from W's panels (packed with `halves` where given), x float32 (or bfloat16 rows of even
    width, where the build takes them for these panels) and the result float32 (into `out`, contiguous,
    where given); None where the kernel does not apply."""
    return _run(x, panels, out, bias, out_features, halves, ACT_NONE, build)


def gated_gemm(x: torch.Tensor, panels: torch.Tensor, halves: int, bias: torch.Tensor | None, out: torch.Tensor,
               build: GemmBuild | None = None) -> torch.Tensor | None:
    """SiLU(x G^T + b_G) * (x U^T + b_U) from the panels of a gated MLP's gate and up weights packed with
    `halves` (their width), into `out` [rows, halves]: float32, or bfloat16 rows for a product that takes
    them. The sums meet the activation as they are stored, so neither half is written out first."""
    act = ACT_SILU_BF16 if out.dtype is torch.bfloat16 else ACT_SILU_F32
    return _run(x, panels, out, bias, 2 * halves, halves, act, build)


def _run(x: torch.Tensor, panels: torch.Tensor, out: torch.Tensor | None, bias: torch.Tensor | None,
         out_features: int, halves: int, act: int, build: GemmBuild | None) -> torch.Tensor | None:
    """The kernel's call (a fresh float32 `out` where none is given, once the kernel is known to apply)."""
    build = build or gemm_build()
    if build is None or x.stride(1) != 1 or torch.is_grad_enabled():
        return None
    takes_rows = panels.dtype is torch.bfloat16 and build.bf16_rows
    if x.dtype is torch.bfloat16:  # rows rounded already, by the kernel that wrote them
        if not takes_rows or x.shape[1] % 2:
            return None
    elif x.dtype is not torch.float32:
        return None
    elif takes_rows:
        x = bf16_rows(x)
    rows, width = x.shape
    if out is None:
        out = torch.empty((rows, out_features), dtype=torch.float32)
    split = (rows >= SPLIT_ROWS and rows * out_features * width >= SPLIT_MACS) or panels.nbytes >= SPLIT_BYTES
    units = panels.shape[0] // 2 if halves else panels.shape[0]  # pairs of panels are claimed whole
    args = (x.data_ptr(), x.stride(0), panels.data_ptr(), 0 if bias is None else bias.data_ptr(),
            out.data_ptr(), out.stride(0), rows, out_features, width, halves, act)
    done = native.share_units(build.kernels[panels.dtype], args, units, split, CHUNKS_PER_THREAD)
    return out if done == 0 else None


def bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16, its rows padded with a zero to an even length (the dot product takes
    pairs); a large copy in scratch memory, which the call that takes it is done with on return."""
    rows, width = x.shape
    rounded = step_scratch.take_if_large("bfloat16 rows", (rows, width + width % 2), torch.bfloat16, x.device)
    if width % 2:
        rounded[:, :width].copy_(x)
        rounded[:, width] = 0
    else:
        rounded.copy_(x)
    return rounded


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` in x's dtype, whatever the weight's."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    panels: torch.Tensor | None = None
    halves = 0  # a gated MLP's fused gate and up projection: each half's width, its panels packed in pairs (gated)
    # Where a model's use of this layer's output ends before the next layer of the same role runs
    # (within one decoder layer), a large output is written into a buffer of that name, reused
    # (kernels/workspace.py); None: a fresh tensor, for outputs that live on (the logits).
    output_slot: str | None = None

    def pack(self) -> None:
        """Pack the weight for `cpu_gemm.c`, where it will run: a CPU, a kernel for its dtype at hand."""
        weight = self.weight
        if (weight.device.type == "cpu" and packs(weight.dtype)
                and (self.bias is None or (self.bias.is_contiguous() and self.bias.dtype is torch.float32))):
            self.panels = pack(weight.detach(), halves=self.halves)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    @property
    def takes_bf16_rows(self) -> bool:
        """Whether this layer's kernel multiplies bfloat16 rows of x: its input may be written as such
        by the kernel before it (norm, activation), saving a pass that rounds float32 rows."""
        panels = self.panels
        if panels is None or panels.dtype is not torch.bfloat16 or self.in_features % 2:
            return False
        build = gemm_build()
        return build is not None and build.bf16_rows

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T`, plus `bias` where given (the row-parallel projections of tensor parallelism add
        theirs after the all-reduce)."""
        if self.panels is not None and x.dim() == 2:
            out = step_scratch.take_if_large(self.output_slot, (x.shape[0], self.out_features), torch.float32,
                                             x.device)
            if self._prompt_by_onednn(x):
                with every_kernel_thread():
                    out.copy_(F.linear(x.to(torch.bfloat16), self.weight))
                return out if bias is None else out.add_(bias)
            if gemm(x, self.panels, self.out_features, bias, out=out, halves=self.halves) is not None:
                return out
        if x.dtype is torch.bfloat16 and self.weight.dtype is not torch.bfloat16:
            x = x.float()
        return linear(x, self.weight, bias)

    def _prompt_by_onednn(self, x: torch.Tensor) -> bool:
        panels = self.panels
        return (panels is not None and panels.dtype is torch.bfloat16 and x.shape[0] >= PROMPT_ROWS
                and self.weight.dtype is torch.bfloat16 and prompt_products() == "onednn")

    def gated(self, x: torch.Tensor, bf16_rows: bool) -> torch.Tensor | None:
        """SiLU(gate) * up of this fused gate and up projection (`halves` set), the activation applied as the
        kernel stores its sums: float32 rows, or bfloat16 rows for a product that takes them. None where the
        kernel does not run here (then `forward`, and the activation apart)."""
        if self.panels is None or not self.halves or x.dim() != 2 or self._prompt_by_onednn(x):
            return None
        shape, dtype = (x.shape[0], self.halves), torch.bfloat16 if bf16_rows else torch.float32
        return gated_gemm(x, self.panels, self.halves, self.bias,
                          step_scratch.take_if_large("activation rows", shape, dtype, x.device))


def pack_weights(model: nn.Module) -> None:
    """Every `Linear` of `model` packed for the CPU kernel, where it applies."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
