"""Linear layers on a CPU: the packed kernels of `cpu_gemm.c`, where torch's own are slow (its BLAS on
AMD CPUs, and any bfloat16 or float16 weight on a CPU without their instructions; docs/kernel-measurements.md).

Weights are packed into panels when the model loads (`pack`), in the layout of the build that runs
(`GemmBuild`: its panel width, and whether bfloat16 weights meet bfloat16 rows of x in the AVX512-BF16
dot product or float32 rows converted in registers). x and y are float32 in every format, so only the
weights' bytes change with the dtype. A call's panels are shared by the threads (`native.share_units`).

A model's `Linear` layer (services/worker/models/linear.py) calls these through its method: float panels
(`gemm`, `gated_gemm`) or, for weights quantized by groups of inputs, codes (`gemm_codes`).

On a CPU with AMX tiles for bfloat16 a prompt's product of bfloat16 weights (PROMPT_ROWS rows or more)
goes to oneDNN through torch, which multiplies in those tiles; the packed kernel keeps a decode's few
rows, which reading the weights bounds (`prompt_products`). Codes keep `gemm_codes` for prompts too where it
multiplies in the tiles itself (`code_prompt_products`): it unpacks each panel once a call, where oneDNN would
need the whole weight unpacked first.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from kernels import choice, native
from kernels.codes_words_choice import ROW_COUNTS, rows_words_win
from kernels.workspace import step_scratch

SPLIT_MACS = 1 << 21  # below this many multiply-adds a call is not worth sharing between threads
SPLIT_ROWS = 4  # nor below this many rows, where reading the weight bounds it, unless the weight is larger
SPLIT_BYTES = 4 << 20  # than this: then a second core reads it faster (docs/kernel-measurements.md)
SPLIT_CODES = 1 << 19  # values of a weight as codes from which one row's product is shared (gemm_codes)
CHUNKS_PER_THREAD = 8  # a shared call's panels come in this many chunks per thread, claimed in turn
SYMBOLS = {torch.float32: "gemm_f32", torch.float16: "gemm_f16", torch.bfloat16: "gemm_bf16"}
ACT_NONE, ACT_SILU_F32, ACT_SILU_BF16 = 0, 1, 2  # what a call stores (cpu_gemm.c's enum activation)
ALL_ROWS = 1 << 30  # every row of a product, as a limit on rows
# the weight on which the build times int16 words against the bfloat16 dot product: one thread's product in the
# second-level cache, of 8 panels
WORDS_PROBE_INPUTS, WORDS_PROBE_GROUP, WORDS_PROBE_PANELS = 1024, 128, 8
PROMPT_ROWS = 64  # rows from which a bfloat16 product is bound by arithmetic, not by reading the weight


@dataclass(frozen=True, slots=True)
class GemmBuild:
    """One build of cpu_gemm.c: its kernel per weight dtype and what packing and calling them needs."""

    kernels: dict[torch.dtype, Callable[..., Any]]
    codes: Callable[..., Any]  # gemm_codes: weights quantized by groups of k
    codes_bf16: Callable[..., Any]  # codes_bf16_weight: such a weight as a bfloat16 matrix
    panel_width: int
    bf16_rows: bool  # bfloat16 weights take x rounded to bfloat16 (the dot product), not float32
    description: str
    variant: str
    code_tiles: Callable[[int], int]  # gemm_codes_use_amx: whether 16 rows or more of codes use AMX tiles (-1 asks)
    code_words: Callable[[int], int]  # gemm_codes_words_rows: up to how many decode rows meet 4-bit codes as int16


@functools.cache
def gemm_build(variant: str | None = None) -> GemmBuild | None:
    """The build that runs here (or `variant`'s), None where none loads."""
    p, i = native.POINTER, native.INT64
    arguments = [p, i, p, p, p, i, i, i, i, i, i, i, p, i]
    kernels = {
        dtype: native.function("cpu_gemm", symbol, arguments, i, variant=variant) for dtype, symbol in SYMBOLS.items()
    }
    codes = native.function(
        "cpu_gemm", "gemm_codes", [p, i, i, p, p, p, i, i, p, p, i, i, i, i, i, p, i], i, variant=variant
    )
    codes_bf16 = native.function("cpu_gemm", "codes_bf16_weight", [p, p, p, i, i, p, i, i, i, p, i], i, variant=variant)
    facts = {
        name: native.function("cpu_gemm", f"gemm_{name}", [], i, variant=variant)
        for name in ("panel_width", "bf16_reads_bf16_rows")
    }
    code_tiles = native.function("cpu_gemm", "gemm_codes_use_amx", [i], i, variant=variant)
    code_words = native.function("cpu_gemm", "gemm_codes_words_rows", [i], i, variant=variant)
    switches = (codes, codes_bf16, code_tiles, code_words)
    if None in facts.values() or None in kernels.values() or None in switches:
        return None
    library = native.load("cpu_gemm", variant)
    assert library is not None  # its functions loaded
    library.gemm_description.restype = native.ctypes.c_char_p
    width, bf16_rows = (fact() for fact in facts.values())
    description = library.gemm_description().decode()
    if code_tiles(int(native.cpu_flags() >= native.AMX_BF16)):
        description += ", AMX tiles for 4-bit codes from a few bfloat16 rows and for any codes from 64"
    build = GemmBuild(
        kernels,
        codes,
        codes_bf16,
        width,
        bool(bf16_rows),
        description,
        native.variant_of(library),
        code_tiles,
        code_words,
    )
    if not code_words(-1):
        return build
    rows = time_code_words(build)
    if not use_code_words(rows, build):
        return build
    which = "a decode's rows" if rows >= ALL_ROWS else f"up to {rows} of a decode's rows"
    return replace(build, description=f"{description}, {which} against 4-bit codes as int16 (VNNI)")


def use_code_tiles(on: bool, build: GemmBuild | None = None) -> bool:
    """Whether `build` (the one that runs here) multiplies 4-bit codes against 16 bfloat16 rows or more in AMX tiles
    from now on: where asked, the build has the bfloat16 dot product, the CPU has the tiles and Linux lets this
    process use them. The tests compare both ways; the worker keeps what the build chose."""
    build = build or gemm_build()
    return build is not None and bool(build.code_tiles(int(on and native.cpu_flags() >= native.AMX_BF16)))


def use_code_words(on: bool | int, build: GemmBuild | None = None) -> bool:
    """Whether `build` multiplies a decode's 4-bit codes by int16 values of its bfloat16 rows (AVX512-VNNI) from now
    on rather than by the bfloat16 dot product, for every decode (True), none (False) or those of up to `on` rows:
    where asked and the build has them. The tests and benchmarks compare both ways; the worker keeps the build's
    choice, the rows up to which the words were the faster here (`code_words_rows`)."""
    build = build or gemm_build()
    rows = ALL_ROWS if on is True else int(on)
    return build is not None and build.code_words(rows) > 0


def code_words_rows(build: GemmBuild | None = None) -> int:
    """Up to how many of a decode's rows `build` multiplies 4-bit codes by int16 values of them now (0: none): where
    it has them, as many as took less time than the bfloat16 dot product when it loaded
    (kernels/codes_words_choice.py), or as `use_code_words` set since."""
    build = build or gemm_build()
    return 0 if build is None else min(int(build.code_words(-1)), ALL_ROWS)


def time_code_words(build: GemmBuild) -> int:
    """Up to how many of a decode's rows int16 words multiply 4-bit codes faster than the bfloat16 dot product on
    this core, timed now on a weight the second-level cache holds (kernels/codes_words_choice.py); every row where
    they never lost. Leaves the limit as it found it."""
    kept = code_words_rows(build)
    generator = torch.Generator().manual_seed(0)
    out_features = WORDS_PROBE_PANELS * build.panel_width
    codes = torch.randint(0, 16, (out_features, WORDS_PROBE_INPUTS), generator=generator, dtype=torch.uint8)
    scales = torch.rand(out_features, WORDS_PROBE_INPUTS // WORDS_PROBE_GROUP, generator=generator) * 0.01
    packed = pack_codes(codes, scales, -8 * scales, "uint4", build)
    operands = {
        rows: (torch.randn(rows, WORDS_PROBE_INPUTS, generator=generator).bfloat16(), torch.empty(rows, out_features))
        for rows in ROW_COUNTS
    }

    def multiply(rows: int) -> bool:
        x, out = operands[rows]
        return gemm_codes(x, packed, None, out, build=build) is not None

    try:
        with torch.no_grad():
            rows = rows_words_win(lambda words: use_code_words(words, build), multiply)
    finally:
        use_code_words(kept, build)
    return ALL_ROWS if rows is None else rows


def code_tiles_on(build: GemmBuild | None = None) -> bool:
    """Whether `build` (the one that runs here) multiplies codes in AMX tiles now (`use_code_tiles`)."""
    build = build or gemm_build()
    return build is not None and bool(build.code_tiles(-1))


def code_prompt_products() -> str:
    """Who multiplies a prompt's bfloat16 rows (PROMPT_ROWS or more) against codes: "native" (`gemm_codes`, in AMX
    tiles where it has them) or "onednn" (the weight unpacked whole to bfloat16 each call, for torch's product).
    `--prompt-products` forces one; else the native kernel where it has the tiles, and as for bfloat16 weights
    where it has not."""
    forced = choice.current().prompt_products
    if forced != "auto":
        return forced
    return "native" if code_tiles_on() else _by_tiles()


def prompt_products() -> str:
    """Who multiplies a prompt's bfloat16 rows (PROMPT_ROWS or more): "onednn" (torch's product) where the CPU has
    AMX tiles for bfloat16, whose multiply rate is several times the dot product's, else "native" (the packed
    kernels); `--prompt-products` forces one (kernels/choice.py)."""
    forced = choice.current().prompt_products
    return forced if forced != "auto" else _by_tiles()


@functools.cache
def _by_tiles() -> str:
    return "onednn" if "amx_bf16" in native.cpu_flags() and torch.backends.mkldnn.is_available() else "native"


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
    assert build is not None, "no gemm kernel builds here"
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


def gemm(
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    build: GemmBuild | None = None,
    out: torch.Tensor | None = None,
    halves: int = 0,
) -> torch.Tensor | None:
    """`x W^T + b` from W's panels (packed with `halves` where given), x float32 (or bfloat16 rows of even
    width, where the build takes them for these panels) and the result float32 (into `out`, contiguous,
    where given); None where the kernel does not apply."""
    return _run(x, panels, out, bias, out_features, halves, ACT_NONE, build)


def gated_gemm(
    x: torch.Tensor,
    panels: torch.Tensor,
    halves: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    build: GemmBuild | None = None,
) -> torch.Tensor | None:
    """SiLU(x G^T + b_G) * (x U^T + b_U) from the panels of a gated MLP's gate and up weights packed with
    `halves` (their width), into `out` [rows, halves]: float32, or bfloat16 rows for a product that takes
    them. The sums meet the activation as they are stored, so neither half is written out first."""
    act = ACT_SILU_BF16 if out.dtype is torch.bfloat16 else ACT_SILU_F32
    return _run(x, panels, out, bias, 2 * halves, halves, act, build)


def _run(
    x: torch.Tensor,
    panels: torch.Tensor,
    out: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
    halves: int,
    act: int,
    build: GemmBuild | None,
) -> torch.Tensor | None:
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
    args = (
        x.data_ptr(),
        x.stride(0),
        panels.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        rows,
        out_features,
        width,
        halves,
        act,
    )
    done = native.share_units(build.kernels[panels.dtype], args, units, split, CHUNKS_PER_THREAD)
    return out if done == 0 else None


CODE_KINDS = {"uint4": 0, "uint8": 1, "fp8": 2}  # cpu_gemm.c's enum code_kind
CODES_PER_WORD = {"uint4": 8, "uint8": 4, "fp8": 4}
# Where code j of a word lies: bytes in order; 4-bit codes of even j in the low half, of odd j in the high.
_BYTES = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
CODE_SHIFTS = {"uint4": torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int32), "uint8": _BYTES, "fp8": _BYTES}


@dataclass(frozen=True, slots=True)
class CodePanels:
    """A weight quantized by groups of k, packed for `gemm_codes` (cpu_gemm.c): codes [panels, K / per word, width]
    words, and a scale and an offset per column and group, [panels, K / group, width] each."""

    panels: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    kind: str
    group: int
    out_features: int
    in_features: int


def pack_codes(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, kind: str, build: GemmBuild | None = None
) -> CodePanels:
    """`codes` [N, K] (uint8: a 4-bit code, a byte, or an e4m3 number's bits) whose values are code x scale + offset
    with `scales` and `offsets` [N, K / group] float32, as the build's panels."""
    build = build or gemm_build()
    assert build is not None, "no gemm kernel builds here"
    width = build.panel_width
    n, k = codes.shape
    groups = scales.shape[1]
    panels, per_word = -(-n // width), CODES_PER_WORD[kind]
    padded = torch.zeros(panels * width, k, dtype=torch.int32)
    padded[:n] = codes.to(torch.int32)
    shifted = padded.view(panels * width, k // per_word, per_word) << CODE_SHIFTS[kind]
    words = shifted.sum(2, dtype=torch.int32)  # the codes' bits do not overlap: their sum is their union
    words = words.view(panels, width, -1).transpose(1, 2).contiguous()

    def by_panel(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(panels * width, groups, dtype=torch.float32)
        out[:n] = values
        return out.view(panels, width, groups).transpose(1, 2).contiguous()

    return CodePanels(words, by_panel(scales), by_panel(offsets), kind, k // groups, n, k)


def gemm_codes(
    x: torch.Tensor,
    packed: CodePanels,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    build: GemmBuild | None = None,
    bf16_x: bool = False,
) -> torch.Tensor | None:
    """`x W^T + b` from W's codes, x float32 (rounded to bfloat16 rows first with `bf16_x`, where the build takes
    them; or given as such, of even width) and the result float32 (into `out` where given); None where the kernel
    does not apply."""
    build = build or gemm_build()
    if build is None or x.stride(1) != 1 or torch.is_grad_enabled():
        return None
    if x.dtype is torch.bfloat16:
        if not build.bf16_rows or x.shape[1] % 2:
            return None
    elif x.dtype is not torch.float32:
        return None
    elif bf16_x and build.bf16_rows and x.shape[1] % 2 == 0:
        x = bf16_rows(x)
    rows, width = x.shape
    if out is None:
        out = torch.empty((rows, packed.out_features), dtype=torch.float32)
    # Unpacking codes costs arithmetic as well as reads: even one row's product is shared once its weight has
    # SPLIT_CODES values (some fifteen microseconds of one core), where a second core's start costs a few.
    weights = packed.out_features * width
    split = rows >= SPLIT_ROWS and rows * weights >= SPLIT_MACS or weights >= SPLIT_CODES
    args = (
        x.data_ptr(),
        x.stride(0),
        int(x.dtype is torch.bfloat16),
        packed.panels.data_ptr(),
        packed.scales.data_ptr(),
        packed.offsets.data_ptr(),
        packed.group,
        CODE_KINDS[packed.kind],
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        rows,
        packed.out_features,
        width,
    )
    done = native.share_units(build.codes, args, packed.panels.shape[0], split, CHUNKS_PER_THREAD)
    return out if done == 0 else None


def codes_as_bf16(packed: CodePanels, out: torch.Tensor, build: GemmBuild | None = None) -> torch.Tensor | None:
    """The weight that `packed` stands for, as a contiguous bfloat16 [N, K] in `out`, each value rounded as a
    prompt's panels round it; None where the build cannot."""
    build = build or gemm_build()
    n, k = packed.out_features, packed.in_features
    if build is None or k % 2 or out.shape != (n, k) or out.dtype is not torch.bfloat16 or not out.is_contiguous():
        return None
    args = (
        packed.panels.data_ptr(),
        packed.scales.data_ptr(),
        packed.offsets.data_ptr(),
        packed.group,
        CODE_KINDS[packed.kind],
        out.data_ptr(),
        n,
        k,
    )
    done = native.share_units(build.codes_bf16, args, packed.panels.shape[0], n * k >= SPLIT_CODES, CHUNKS_PER_THREAD)
    return out if done == 0 else None


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 weight [N, K] that `codes` stand for (the reference for `gemm_codes`)."""
    group = codes.shape[1] // scales.shape[1]
    values = codes.view(torch.float8_e4m3fn).float() if kind == "fp8" else codes.float()
    return values * scales.repeat_interleave(group, 1) + offsets.repeat_interleave(group, 1)


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
