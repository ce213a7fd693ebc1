"""The quantized products' kernels on every build this CPU runs, against the portable build and torch:

- W8A8 (`cpu_int8_gemm.c`): x quantized per row and multiplied in int32, so every build (AVX512-VNNI's byte dot
  product, AVX2's int16 pairs, plain C) gives the same floats bit for bit, and the torch reference does too;
- weights as codes (`gemm_codes` of cpu_gemm.c: 4-bit, 8-bit and FP8 codes by groups): float sums in another
  order per build, so within a bound: 1e-5 of the sum of |x| |w| for float32 rows; for a build that takes
  bfloat16 rows, the reference on the same bfloat16 rows, and for a prompt's rows (weights rounded to bfloat16
  before the dot product) 2^-8 of that sum."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels import cpu_int8_linear, cpu_linear, native

BUILDS = native.runnable_variants()
SHAPES = [(1, 70, 100), (3, 33, 64), (6, 40, 36), (7, 100, 13), (37, 96, 256), (130, 64, 516)]  # rows, N, K
STREAM_ROWS = 32  # cpu_gemm.c's: up to this many rows the codes are unpacked in registers
CODE_SHAPES = [(1, 70, 128, 32), (5, 33, 64, 64), (9, 64, 256, 256), (33, 100, 256, 128), (70, 40, 96, 32)]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def build_or_skip(loader, variant: str | None):
    """The build, skipping only where no compiler is found or this CPU cannot run it: one that fails to compile
    fails the test."""
    build = loader(variant)
    if build is None:
        if shutil.which(os.environ.get("CC", "cc")) and (variant is None or variant in native.runnable_variants()):
            pytest.fail(f"the {variant or 'native'} build of a kernel does not compile or load here")
        pytest.skip(f"no {variant} build here (no compiler, or this CPU cannot run it)")
    return build


@pytest.mark.slow  # compiles every build afresh: `make test`, not the inner loop
@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_every_int8_build_quantizes_and_multiplies_as_the_portable_build_bit_for_bit(variant, static):
    build = build_or_skip(cpu_int8_linear.int8_build, variant)
    portable = build_or_skip(cpu_int8_linear.int8_build, "portable")
    generator = torch.Generator().manual_seed(0)
    for rows, n, k in SHAPES:
        x = torch.randn(rows, k, generator=generator) * 3
        x[0, 0] = -x[0].abs().max()  # a row's largest magnitude negative: its code is -128
        weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
        weight[0, :4] = -128  # weights reach -128 too: no product of two may saturate
        w_scales, bias = torch.rand(n, generator=generator) + 0.01, torch.randn(n, generator=generator)
        scale = 0.05 if static else 0.0
        codes, scales = cpu_int8_linear.quantize_rows(x, scale, build, name=None)
        reference_codes, reference_scales = cpu_int8_linear.quantize_rows_reference(x, scale)
        assert torch.equal(codes[:, :k], reference_codes) and torch.equal(scales, reference_scales)
        assert not codes[:, k:].any()  # the padding of a row's last word
        for with_bias in (bias, None):
            want = cpu_int8_linear.int8_linear_reference(x, weight, w_scales, with_bias, scale)
            for b in (build, portable):
                got = cpu_int8_linear.int8_linear(
                    x, cpu_int8_linear.pack_int8(weight, b), w_scales, with_bias, scale, build=b
                )
                assert torch.equal(got, want), (variant, b.variant, rows, n, k)


@pytest.mark.parametrize("threads", [1, 2])
def test_an_int8_product_shared_by_threads_is_the_same(threads, monkeypatch):
    build = build_or_skip(cpu_int8_linear.int8_build, None)
    monkeypatch.setattr(cpu_int8_linear, "SPLIT_MACS", 0)
    native.set_threads(threads)
    for rows in (1, 50, 2000):  # 2,000 rows of 300 codes: three blocks of rows, each quantized by the thread at it
        x, weight = torch.randn(rows, 300), torch.randint(-128, 128, (200, 300), dtype=torch.int8)
        got = cpu_int8_linear.int8_linear(x, cpu_int8_linear.pack_int8(weight, build), torch.ones(200), None)
        assert torch.equal(got, cpu_int8_linear.int8_linear_reference(x, weight, torch.ones(200), None))


def codes_of(kind: str, n: int, k: int, group: int, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if kind == "fp8":
        codes = (torch.randn(n, k, generator=generator) * 4).to(torch.float8_e4m3fn).view(torch.uint8)
        codes[0, :3] = torch.tensor([0x01, 0x81, 0x07], dtype=torch.uint8)  # subnormal numbers, both signs
        offsets = torch.zeros(n, k // group)
    else:
        top = 16 if kind == "uint4" else 256
        codes = torch.randint(0, top, (n, k), dtype=torch.uint8, generator=generator)
        offsets = -torch.randint(0, top, (n, k // group), generator=generator).float()
    scales = torch.rand(n, k // group, generator=generator) * 0.1 + 0.01
    return codes, scales, offsets * scales


def relative_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> float:
    exact = x.double() @ weight.double().T + bias.double()
    magnitude = x.double().abs() @ weight.double().abs().T + 1
    return ((got.double() - exact).abs() / magnitude).max().item()


@pytest.mark.slow  # compiles every build afresh: `make test`, not the inner loop
@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("kind", ["uint4", "uint8", "fp8"])
def test_every_codes_build_multiplies_as_the_portable_build_within_its_bound(variant, kind):
    build = build_or_skip(cpu_linear.gemm_build, variant)
    portable = build_or_skip(cpu_linear.gemm_build, "portable")
    generator = torch.Generator().manual_seed(1)
    for rows, n, k, group in CODE_SHAPES:
        codes, scales, offsets = codes_of(kind, n, k, group, generator)
        weight = cpu_linear.dequantize_codes(codes, scales, offsets, kind)
        x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
        ours = cpu_linear.gemm_codes(x, cpu_linear.pack_codes(codes, scales, offsets, kind, build), bias, build=build)
        theirs = cpu_linear.gemm_codes(
            x, cpu_linear.pack_codes(codes, scales, offsets, kind, portable), bias, build=portable
        )
        assert relative_error(theirs, x, weight, bias) < 1e-5
        assert relative_error(ours, x, weight, bias) < 1e-5
        assert ((ours - theirs).abs() / (x.abs() @ weight.abs().T + 1)).max() < 2e-5
        if build.bf16_rows:  # the same rows rounded to bfloat16: decode rows exact codes, prompt rows bf16 weights
            rounded = x.bfloat16().float()
            got = cpu_linear.gemm_codes(
                x, cpu_linear.pack_codes(codes, scales, offsets, kind, build), bias, build=build, bf16_x=True
            )
            bound = 2**-8 if rows > STREAM_ROWS else 1e-5
            assert relative_error(got, rounded, weight, bias) < bound, (variant, kind, rows, n, k)


def test_codes_shared_by_threads_give_the_same_product(monkeypatch):
    build = build_or_skip(cpu_linear.gemm_build, None)
    monkeypatch.setattr(cpu_linear, "SPLIT_MACS", 0)
    generator = torch.Generator().manual_seed(2)
    codes, scales, offsets = codes_of("uint4", 300, 512, 128, generator)
    packed = cpu_linear.pack_codes(codes, scales, offsets, "uint4", build)
    for rows in (1, 4, 40):
        x = torch.randn(rows, 512, generator=generator)
        native.set_threads(1)
        alone = cpu_linear.gemm_codes(x, packed, None, build=build, bf16_x=build.bf16_rows)
        native.set_threads(2)
        assert torch.equal(cpu_linear.gemm_codes(x, packed, None, build=build, bf16_x=build.bf16_rows), alone)


def test_four_bit_codes_lie_in_words_as_the_kernel_takes_them():
    build = build_or_skip(cpu_linear.gemm_build, None)
    codes = torch.arange(16, dtype=torch.uint8).repeat(build.panel_width, 1)  # every column codes 0..15
    packed = cpu_linear.pack_codes(
        codes, torch.ones(build.panel_width, 1), torch.zeros(build.panel_width, 1), "uint4", build
    )
    first = int(packed.panels[0, 0, 0]) & 0xFFFFFFFF
    # inputs 0, 2, 4, 6 in the low half's nibbles, 1, 3, 5, 7 in the high half's
    assert [(first >> shift) & 15 for shift in (0, 4, 8, 12, 16, 20, 24, 28)] == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_products_in_amx_tiles_are_the_vnni_products_bit_for_bit(static, threads, monkeypatch):
    """Where the CPU has AMX tiles for int8, blocks of 16 rows are multiplied in them (k past the last whole 64 by
    the VNNI loop, added to the tiles' sums), passing the panels a group at a time (on one thread, one chunk of
    1,100 columns of 1,000 inputs is more than a group): the same int32 sums, so the same floats."""
    monkeypatch.setattr(native, "_threads", threads)
    build = build_or_skip(cpu_int8_linear.int8_build, None)
    if not cpu_int8_linear.use_tiles(True, build):
        pytest.skip("no AMX tiles for int8 on this CPU")
    generator = torch.Generator().manual_seed(7)
    scale = 0.05 if static else 0.0
    try:
        for rows, n, k in [
            (16, 32, 64),
            (17, 70, 100),
            (48, 96, 1000),
            (130, 64, 516),
            (700, 40, 256),
            (40, 1100, 1000),
        ]:
            x = torch.randn(rows, k, generator=generator) * 3
            weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
            w_scales, bias = torch.rand(n, generator=generator) + 0.01, torch.randn(n, generator=generator)
            packed = cpu_int8_linear.pack_int8(weight, build)
            want = cpu_int8_linear.int8_linear_reference(x, weight, w_scales, bias, scale)
            for tiles in (True, False):
                cpu_int8_linear.use_tiles(tiles, build)
                got = cpu_int8_linear.int8_linear(x, packed, w_scales, bias, scale, build=build)
                assert torch.equal(got, want), (tiles, rows, n, k)
    finally:
        cpu_int8_linear.use_tiles(True, build)


def code_tiles_build_or_skip():
    """The build that runs here, its codes kernel's AMX tiles on; a skip where the CPU (or the build) has none."""
    build = build_or_skip(cpu_linear.gemm_build, None)
    if not build.bf16_rows or not cpu_linear.use_code_tiles(True, build):
        pytest.skip("no AMX tiles for bfloat16 here (or no bfloat16 dot product in this build)")
    return build


def products_without_and_with_code_tiles(x, packed, bias, build) -> dict[bool, torch.Tensor]:
    """`gemm_codes` of x with the codes kernel's AMX tiles off (False) and on (True)."""
    got = {}
    for tiles in (False, True):
        assert cpu_linear.use_code_tiles(tiles, build) == tiles
        got[tiles] = cpu_linear.gemm_codes(x, packed, bias, build=build)
    return got


def test_four_bit_codes_in_amx_tiles_are_the_dot_products_sums_in_another_order():
    """Where the CPU has AMX tiles for bfloat16, 4-bit codes meet blocks of 16 bfloat16 rows (of up to 63 rows) in
    them, and the rows past the last whole 16, from two, in a tile padded with zero rows (a single one in the dot
    product): the same exact code values and group corrections as the dot product's decode rows, the sums within a
    group in another order."""
    build = code_tiles_build_or_skip()
    generator = torch.Generator().manual_seed(8)
    try:
        for rows, n, k, group in [(16, 32, 64, 32), (17, 70, 256, 64), (31, 64, 512, 128), (48, 40, 768, 256),
                                  (63, 96, 384, 384), (16, 33, 96, 32), (2, 40, 128, 32), (5, 70, 256, 128),
                                  (15, 33, 96, 32), (18, 64, 256, 64), (1, 32, 64, 32)]:  # fmt: skip
            codes, scales, offsets = codes_of("uint4", n, k, group, generator)
            weight = cpu_linear.dequantize_codes(codes, scales, offsets, "uint4")
            packed = cpu_linear.pack_codes(codes, scales, offsets, "uint4", build)
            x, bias = torch.randn(rows, k, generator=generator).bfloat16(), torch.randn(n, generator=generator)
            got = products_without_and_with_code_tiles(x, packed, bias, build)
            assert relative_error(got[True], x.float(), weight, bias) < 1e-5, (rows, n, k, group)
            # without the tiles, past STREAM_ROWS rows the weight is rounded to bfloat16 (a prompt's panels)
            bound = 2e-5 if rows <= STREAM_ROWS else 2**-8
            assert ((got[True] - got[False]).abs() / (x.float().abs() @ weight.abs().T + 1)).max() < bound
    finally:
        cpu_linear.use_code_tiles(True, build)


@pytest.mark.parametrize("kind", ["uint4", "uint8", "fp8"])
def test_a_prompts_rows_meet_each_panel_unpacked_once_in_amx_tiles(kind):
    """Where the CPU has AMX tiles for bfloat16, a prompt's bfloat16 rows (64 or more) meet each panel's values,
    unpacked once a call, in tiles: blocks of 16 rows there, the last few rows in the dot product, and a
    width that is not a multiple of 32 in the dot product alone. The values are rounded to bfloat16 as the vector
    path rounds them, so only the order of the sums differs."""
    build = code_tiles_build_or_skip()
    generator = torch.Generator().manual_seed(9)
    try:
        # (rows, n, k, group): 85 rows are blocks of 32 and 21, the 21 one tile block of 16 and 5 rows in the dot
        # product; 8,192 inputs make panels of 512 KiB, so a thread's panels are unpacked two at a time; k = 80
        # takes no tiles
        for rows, n, k, group in [(64, 32, 64, 32), (85, 70, 256, 64), (100, 96, 384, 128), (64, 100, 8192, 128),
                                  (70, 40, 80, 16)]:  # fmt: skip
            codes, scales, offsets = codes_of(kind, n, k, group, generator)
            weight = cpu_linear.dequantize_codes(codes, scales, offsets, kind)
            packed = cpu_linear.pack_codes(codes, scales, offsets, kind, build)
            x, bias = torch.randn(rows, k, generator=generator).bfloat16(), torch.randn(n, generator=generator)
            got = products_without_and_with_code_tiles(x, packed, bias, build)
            assert cpu_linear.code_tiles_on(build)
            magnitude = x.float().abs() @ weight.abs().T + 1
            assert ((got[True] - got[False]).abs() / magnitude).max() < 1e-5, (kind, rows, n, k)
            assert relative_error(got[True], x.float(), weight, bias) < 2**-7, (kind, rows, n, k)
    finally:
        cpu_linear.use_code_tiles(True, build)


@pytest.mark.slow  # compiles every build afresh: `make test`, not the inner loop
@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("kind", ["uint4", "uint8", "fp8"])
def test_every_build_unpacks_codes_into_the_bfloat16_weight_they_stand_for(variant, kind):
    """For a prompt's product by oneDNN: each value rounded to bfloat16 once, within a bfloat16 unit of its terms
    (a build that fuses the multiply-add rounds code x scale + offset once, torch's reference twice); a prompt's
    product over it is the packed kernel's over its own panels, but for the order of the sums."""
    build = build_or_skip(cpu_linear.gemm_build, variant)
    generator = torch.Generator().manual_seed(4)
    for n, k, group in [(70, 128, 32), (33, 64, 64), (100, 96, 32), (64, 256, 128), (5, 40, 8)]:
        codes, scales, offsets = codes_of(kind, n, k, group, generator)
        weight = cpu_linear.dequantize_codes(codes, scales, offsets, kind)
        packed = cpu_linear.pack_codes(codes, scales, offsets, kind, build)
        unpacked = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
        assert cpu_linear.codes_as_bf16(packed, unpacked, build) is unpacked
        # the scale of the value's terms, code x scale and offset: their sum can cancel
        values = codes.view(torch.float8_e4m3fn).float() if kind == "fp8" else codes.float()
        terms = values.abs() * scales.repeat_interleave(group, 1) + offsets.abs().repeat_interleave(group, 1)
        assert ((unpacked.float() - weight).abs() <= terms * 2**-8).all(), (variant, kind, n, k)
        if build.bf16_rows:
            x = torch.randn(cpu_linear.PROMPT_ROWS, k, generator=generator)  # a prompt's: past every decode path
            panels = cpu_linear.gemm_codes(x, packed, None, build=build, bf16_x=True)
            by_torch = x.bfloat16().float() @ unpacked.float().T
            magnitude = x.abs() @ weight.abs().T + 1
            assert ((panels - by_torch).abs() / magnitude).max() < 1e-5


def test_codes_unpacked_by_threads_are_the_same(monkeypatch):
    build = build_or_skip(cpu_linear.gemm_build, None)
    monkeypatch.setattr(cpu_linear, "SPLIT_CODES", 0)
    codes, scales, offsets = codes_of("uint4", 300, 512, 128, torch.Generator().manual_seed(5))
    packed = cpu_linear.pack_codes(codes, scales, offsets, "uint4", build)
    unpacked = [torch.empty(300, 512, dtype=torch.bfloat16) for _ in range(2)]
    for threads, out in zip((1, 2), unpacked):
        native.set_threads(threads)
        cpu_linear.codes_as_bf16(packed, out, build)
    assert torch.equal(*unpacked)


def test_a_prompts_product_of_codes_goes_to_onednn_as_bfloat16_and_a_decodes_stays_packed(kernels_chosen, monkeypatch):
    """Where the CPU has AMX tiles for bfloat16 (forced here), a bfloat16 model's prompt rows are multiplied by
    torch over the weight unpacked once; its decode rows stream the codes."""
    build = build_or_skip(cpu_linear.gemm_build, None)
    from services.worker.models.linear import Linear
    from services.worker.quantization.methods import CodedMethod
    from services.worker.quantization.weights import CodedWeight

    generator = torch.Generator().manual_seed(6)
    codes, scales, offsets = codes_of("uint4", 96, 256, 64, generator)
    layer = Linear(256, 96)
    layer.use(CodedMethod(CodedWeight(codes, scales, offsets, "uint4")))
    layer.bias.data = torch.randn(96, generator=generator)
    layer.prepare(torch.bfloat16)
    prompt, decode = torch.randn(cpu_linear.PROMPT_ROWS + 3, 256), torch.randn(3, 256)
    native_products = layer(prompt).clone(), layer(decode).clone()
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: calls.append(x.shape) or linear(x, w, b))
    kernels_chosen(prompt_products="onednn")
    by_onednn = layer(prompt)
    assert torch.equal(layer(decode), native_products[1])
    weight = cpu_linear.dequantize_codes(codes, scales, offsets, "uint4")
    if build.bf16_rows:  # a bfloat16 model's rows
        assert calls == [(cpu_linear.PROMPT_ROWS + 3, 256)]
        assert relative_error(by_onednn, prompt.bfloat16().float(), weight, layer.bias) < 2**-7
    else:  # float32 rows keep the packed kernel
        assert calls == [] and torch.equal(by_onednn, native_products[0])


def test_where_the_codes_kernel_has_amx_tiles_a_prompts_product_stays_with_it(kernels_chosen, monkeypatch):
    """Under `--prompt-products auto` a bfloat16 model's prompt rows against codes stay with the codes kernel where
    it multiplies in AMX tiles (each panel unpacked once a call), rather than the whole weight unpacked for
    oneDNN; without the tiles they go as bfloat16 weights' prompts go."""
    build = code_tiles_build_or_skip()
    from services.worker.models.linear import Linear
    from services.worker.quantization.methods import CodedMethod
    from services.worker.quantization.weights import CodedWeight

    generator = torch.Generator().manual_seed(10)
    codes, scales, offsets = codes_of("uint4", 64, 256, 128, generator)
    layer = Linear(256, 64)
    layer.use(CodedMethod(CodedWeight(codes, scales, offsets, "uint4")))
    layer.prepare(torch.bfloat16)
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: calls.append(x.shape) or linear(x, w, b))
    kernels_chosen(prompt_products="auto")
    prompt = torch.randn(cpu_linear.PROMPT_ROWS + 32, 256, generator=generator)
    try:
        assert cpu_linear.code_prompt_products() == "native"
        assert "prompts' panels unpacked once into AMX tiles" in layer.method.describe()
        in_tiles = layer(prompt).clone()
        assert calls == []
        weight = cpu_linear.dequantize_codes(codes, scales, offsets, "uint4")
        assert relative_error(in_tiles, prompt.bfloat16().float(), weight, layer.bias.detach()) < 2**-7
        cpu_linear.use_code_tiles(False, build)
        assert cpu_linear.code_prompt_products() == cpu_linear.prompt_products()
    finally:
        cpu_linear.use_code_tiles(True, build)


def expected_codes(x: torch.Tensor, static_scale: float, rows_format) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows as a W8A8 product quantizes them, in `rows_format`: [rows, padded width] codes and scales."""
    assert rows_format.static_scale == static_scale
    rows = cpu_int8_linear.int8_rows_reference(x, rows_format)
    return rows.codes, rows.scales


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("static", [0.0, 0.02], ids=["per-token", "static"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_a_norm_before_a_w8a8_product_writes_the_codes_the_product_would_quantize(
    threads, static, with_residual, monkeypatch
):
    """The RMSNorm before q/k/v and gate/up writes its rows as int8 codes and scales in one pass: exactly the codes
    of the float rows it would have written, and the residual stream added to as the float norm adds to it."""
    from kernels import cpu_norm

    build_or_skip(cpu_int8_linear.int8_build, None)
    monkeypatch.setattr(native, "_threads", threads)
    rows_format = cpu_int8_linear.rows_format(static)
    generator = torch.Generator().manual_seed(3)
    for rows, width in [(1, 70), (3, 768), (130, 514), (300, 256)]:  # 514: a row's last word padded
        x = torch.randn(rows, width, generator=generator) * 2
        weight = torch.rand(width, generator=generator) + 0.5
        residuals = [torch.randn(rows, width, generator=generator)] * 2 if with_residual else [None, None]
        if with_residual:
            residuals[1] = residuals[0].clone()
        floats = cpu_norm.rms_norm(x, weight, 1e-5, residuals[0])
        got = cpu_norm.rms_norm_int8(x, weight, 1e-5, residuals[1], rows_format, "test rows")
        assert got is not None and got.shape == (rows, width)
        codes, scales = expected_codes(floats, static, rows_format)
        assert torch.equal(got.codes, codes) and torch.equal(got.scales, scales), (rows, width)
        if with_residual:
            assert torch.equal(residuals[0], residuals[1])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("static", [0.0, 0.02], ids=["per-token", "static"])
def test_the_activation_before_a_w8a8_down_projection_writes_the_codes_the_product_would_quantize(
    threads, static, monkeypatch
):
    from kernels import cpu_activation

    build_or_skip(cpu_int8_linear.int8_build, None)
    monkeypatch.setattr(native, "_threads", threads)
    rows_format = cpu_int8_linear.rows_format(static)
    generator = torch.Generator().manual_seed(4)
    for rows, width in [(1, 70), (5, 2048), (200, 342)]:
        gate_up = torch.randn(rows, 2 * width, generator=generator) * 3
        gate_up[0, 0] = -1000.0  # SiLU's exponent past its cap
        got = cpu_activation.silu_and_mul_int8(gate_up, width, rows_format)
        floats = cpu_activation.silu_and_mul(gate_up.clone(), width)
        codes, scales = expected_codes(floats, static, rows_format)
        assert got is not None and torch.equal(got.codes, codes) and torch.equal(got.scales, scales), (rows, width)


@pytest.mark.parametrize("static", [0.0, 0.05], ids=["per-token", "static"])
def test_a_w8a8_product_of_rows_quantized_before_it_is_the_product_of_the_float_rows(static, monkeypatch):
    """The product takes the codes the kernel before it wrote and gives the floats it gives for the float rows, bit
    for bit, in the VNNI loop and in AMX tiles (where the CPU has them), on one thread or shared."""
    build = build_or_skip(cpu_int8_linear.int8_build, None)
    monkeypatch.setattr(cpu_int8_linear, "SPLIT_MACS", 0)
    rows_format = cpu_int8_linear.rows_format(static, build)
    generator = torch.Generator().manual_seed(5)
    try:
        for threads in (1, 2):
            monkeypatch.setattr(native, "_threads", threads)
            for rows, n, k in [(1, 70, 100), (5, 64, 256), (16, 32, 64), (40, 96, 1000), (700, 40, 300)]:
                x = torch.randn(rows, k, generator=generator) * 3
                weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
                w_scales, bias = torch.rand(n, generator=generator) + 0.01, torch.randn(n, generator=generator)
                packed = cpu_int8_linear.pack_int8(weight, build)
                rows_in = cpu_int8_linear.rows_buffers("test rows", rows, k, x.device)
                codes, scales = expected_codes(x, static, rows_format)
                rows_in.codes.copy_(codes)
                rows_in.scales.copy_(scales)
                for tiles in (True, False):
                    cpu_int8_linear.use_tiles(tiles, build)
                    want = cpu_int8_linear.int8_linear(x, packed, w_scales, bias, static, build=build)
                    got = cpu_int8_linear.int8_linear(rows_in, packed, w_scales, bias, static, build=build)
                    assert torch.equal(got, want), (threads, tiles, rows, n, k)
    finally:
        cpu_int8_linear.use_tiles(True, build)
