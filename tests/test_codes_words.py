"""A decode's bfloat16 rows against 4-bit codes as int16 values (`kernels/codes_words.h`, builds with AVX512-VNNI):
each group of a row scaled by a power of two that puts its largest magnitude just under 2^15, so a value within
2^7 of that largest one is exact and any other off by at most half a unit; the sums, made from the values' bytes
by the byte dot product, are exact in int32. So the product is the exact product of the rows rounded to those units
(but for float32's rounding of the group sums), within the sum of |w| x half a unit of the exact product of the
same bfloat16 rows; the same however the call is shared or its rows are split among tiles."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_linear, native
from kernels.codes_words_choice import ROW_COUNTS
from tests.test_quantized_kernels import build_or_skip, codes_of, relative_error


@pytest.fixture
def words_build():
    """The build that runs here, its int16 words on; a skip where it has none (no AVX512-VNNI with bfloat16 rows)."""
    build = build_or_skip(cpu_linear.gemm_build, None)
    chosen = cpu_linear.code_words_rows(build)
    if not build.bf16_rows or not cpu_linear.use_code_words(True, build):
        pytest.skip("no int16 words for 4-bit codes in this build (AVX512-VNNI with the bfloat16 dot product)")
    with torch.no_grad():
        yield build
    cpu_linear.use_code_words(chosen, build)
    cpu_linear.use_code_tiles(True, build)


def test_the_build_keeps_words_up_to_the_rows_it_timed_them_faster_and_says_so():
    """Up to how many of a decode's rows 4-bit products go as int16 words is timed once, when the build loads (the
    two instructions' rates differ several-fold between CPUs, not in one direction): one of the row counts timed,
    none or every row, named in the build's description, and timing again leaves the limit where it was."""
    build = build_or_skip(cpu_linear.gemm_build, None)
    chosen = cpu_linear.code_words_rows(build)
    assert ("as int16" in build.description) == (chosen > 0)
    assert chosen in (0, *ROW_COUNTS, cpu_linear.ALL_ROWS)
    assert (f"up to {chosen} of" in build.description) == (chosen in ROW_COUNTS)
    if not build.bf16_rows or not cpu_linear.use_code_words(True, build):
        pytest.skip("no int16 words for 4-bit codes in this build (AVX512-VNNI with the bfloat16 dot product)")
    try:
        for limit in (0, 3, cpu_linear.ALL_ROWS):
            cpu_linear.use_code_words(limit, build)
            assert cpu_linear.time_code_words(build) in (0, *ROW_COUNTS, cpu_linear.ALL_ROWS)
            assert cpu_linear.code_words_rows(build) == limit
    finally:
        cpu_linear.use_code_words(chosen, build)


def test_a_decode_past_the_row_limit_takes_the_bfloat16_dot_product(words_build):
    """With words up to two rows, two rows give the words' sums and three the dot product's, bit for bit as
    those ways give them when forced (in the vector kernel: AMX tiles, where present, off)."""
    build = words_build
    cpu_linear.use_code_tiles(False, build)
    generator = torch.Generator().manual_seed(7)
    codes, scales, offsets = codes_of("uint4", 96, 512, 128, generator)
    packed = cpu_linear.pack_codes(codes, scales, offsets, "uint4", build)
    for rows in (2, 3):
        x = torch.randn(rows, 512, generator=generator).bfloat16()
        by_way = {}
        for way in (True, False):
            cpu_linear.use_code_words(way, build)
            by_way[way] = cpu_linear.gemm_codes(x, packed, None, build=build)
        assert not torch.equal(by_way[True], by_way[False]), rows  # the two ways round differently
        cpu_linear.use_code_words(2, build)
        assert torch.equal(cpu_linear.gemm_codes(x, packed, None, build=build), by_way[rows <= 2]), rows


def rounded_to_units(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each value rounded to the nearest (ties to even) unit of its group: 2^(e - 14), e the exponent of the
    group's largest magnitude (the largest then under 2^15 units)."""
    x64 = x.double()
    largest = x64.abs().reshape(x.shape[0], -1, group).amax(dim=2).clamp_min(2.0**-112)
    unit = torch.pow(2.0, torch.floor(torch.log2(largest)) - 14).repeat_interleave(group, dim=1)
    return torch.round(x64 / unit) * unit


def is_product_of_rounded_rows(got, x, weight, bias, group) -> bool:
    """got is the exact product of x's rows rounded to their units, but for float32's rounding of group sums."""
    w64 = weight.double()
    exact = rounded_to_units(x, group) @ w64.T + bias.double()
    return bool(((got.double() - exact).abs() <= 2e-6 * (x.double().abs() @ w64.abs().T) + 1e-6).all())


@pytest.mark.parametrize("tiles", [False, True], ids=["vector", "amx-tiles-where-present"])
def test_a_decodes_rows_as_int16_words_are_its_rows_rounded_to_their_groups_units(words_build, tiles):
    """Up to 5 rows, and the up to 5 past a decode's last whole 16 where AMX tiles take blocks of 16 (their rows
    the exact bfloat16 rows, as tests/test_quantized_kernels.py holds them); every row without the tiles."""
    build = words_build
    tiles = cpu_linear.use_code_tiles(tiles, build)
    generator = torch.Generator().manual_seed(3)
    cases = [(1, 70, 128, 32), (2, 33, 256, 64), (3, 64, 512, 128), (4, 40, 768, 256), (5, 70, 256, 64),
             (21, 64, 256, 128), (1, 40, 8192, 4096)]  # fmt: skip
    if not tiles:  # 6 rows and more take every row in words; a group of 24 ends in a half block of 16 values
        cases += [(6, 96, 384, 128), (9, 32, 64, 32), (2, 33, 96, 24)]
    for rows, n, k, group in cases:
        codes, scales, offsets = codes_of("uint4", n, k, group, generator)
        weight = cpu_linear.dequantize_codes(codes, scales, offsets, "uint4")
        packed = cpu_linear.pack_codes(codes, scales, offsets, "uint4", build)
        x = torch.randn(rows, k, generator=generator)
        x[:, : k // 2] *= torch.logspace(-12, 3, k // 2, base=2.0)  # magnitudes far below their group's largest
        x = x.bfloat16()
        bias = torch.randn(n, generator=generator)
        got = cpu_linear.gemm_codes(x, packed, bias, build=build)
        in_tiles = 16 if tiles and rows >= 16 else 0
        if in_tiles:
            assert relative_error(got[:in_tiles], x[:in_tiles].float(), weight, bias) < 1e-5
        words = got[in_tiles:]
        assert is_product_of_rounded_rows(words, x[in_tiles:], weight, bias, group), (rows, n, k, group)
        # so within half a unit of each value of the exact product
        half_unit = (rounded_to_units(x, group) - x.double()).abs().amax()
        assert (words.double() - (x[in_tiles:].double() @ weight.double().T + bias.double())).abs().max() <= (
            half_unit * weight.double().abs().sum(1).max() + 1e-3
        )


def test_values_near_their_groups_largest_are_multiplied_exactly(words_build):
    """Rows whose values all lie within 2^7 of their group's largest magnitude become int16 exactly: the product
    is the exact one but for float32's rounding of each group's sum."""
    build = words_build
    generator = torch.Generator().manual_seed(4)
    codes, scales, offsets = codes_of("uint4", 64, 256, 64, generator)
    weight = cpu_linear.dequantize_codes(codes, scales, offsets, "uint4")
    packed = cpu_linear.pack_codes(codes, scales, offsets, "uint4", build)
    signs = torch.randint(0, 2, (3, 256), generator=generator).float() * 2 - 1
    x = (signs * (1 + torch.rand(3, 256, generator=generator)) * 2.0 ** torch.randint(-6, 1, (3, 256))).bfloat16()
    got = cpu_linear.gemm_codes(x, packed, None, build=build).double()
    exact = x.double() @ weight.double().T
    assert ((got - exact).abs() <= 2e-6 * (x.double().abs() @ weight.double().abs().T)).all()


def test_words_and_the_dot_product_agree_and_threads_share_words_alike(words_build, monkeypatch):
    build = words_build
    monkeypatch.setattr(cpu_linear, "SPLIT_MACS", 0)
    generator = torch.Generator().manual_seed(5)
    codes, scales, offsets = codes_of("uint4", 300, 512, 128, generator)
    weight = cpu_linear.dequantize_codes(codes, scales, offsets, "uint4")
    packed = cpu_linear.pack_codes(codes, scales, offsets, "uint4", build)
    for rows in (1, 3, 4):
        x = torch.randn(rows, 512, generator=generator).bfloat16()
        magnitude = x.float().abs() @ weight.abs().T + 1
        native.set_threads(1)
        alone = cpu_linear.gemm_codes(x, packed, None, build=build)
        native.set_threads(2)
        assert torch.equal(cpu_linear.gemm_codes(x, packed, None, build=build), alone), rows
        assert not cpu_linear.use_code_words(False, build)
        pairs = cpu_linear.gemm_codes(x, packed, None, build=build)
        assert cpu_linear.use_code_words(True, build)
        assert ((alone - pairs).abs() / magnitude).max() < 2e-5, rows


def test_groups_too_wide_for_int32_sums_keep_the_bfloat16_dot_product(words_build):
    """A group's sums stay exact in int32 up to 4,096 values; a wider group (a per-channel checkpoint of a wide
    layer) keeps the bfloat16 dot product, whatever the switch says."""
    build = words_build
    generator = torch.Generator().manual_seed(6)
    codes, scales, offsets = codes_of("uint4", 40, 8192, 8192, generator)
    packed = cpu_linear.pack_codes(codes, scales, offsets, "uint4", build)
    x = torch.randn(1, 8192, generator=generator).bfloat16()  # one row: no AMX tiles either way
    with_words = cpu_linear.gemm_codes(x, packed, None, build=build)
    assert not cpu_linear.use_code_words(False, build)
    assert torch.equal(with_words, cpu_linear.gemm_codes(x, packed, None, build=build))
