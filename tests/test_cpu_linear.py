"""The CPU linear kernels against `F.linear`: the packed-panel kernel for every weight dtype (float32,
and bfloat16 and float16 widened in registers), in every build this CPU runs, split over threads or
not, and the layer that picks it."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear, native
from kernels.cpu_activation import silu_and_mul
from kernels.cpu_linear import gated_gemm, gemm, gemm_build, pack
from services.worker.models.linear import Linear, prepare_layers

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(37, 100), (64, 256), (50, 13), (33, 1), (40, 7)]  # partial panels; odd K, down to one


@pytest.fixture(autouse=True)
def compiled_kernel():
    if gemm_build() is None:
        pytest.skip("no C compiler here: the packed linear kernel cannot be built")
    with torch.inference_mode():
        yield


def expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, build) -> torch.Tensor:
    """F.linear in float64 over the values the build multiplies: the weight's own, and x rounded to
    bfloat16 where the build meets a bfloat16 weight with the dot product."""
    if weight.dtype is torch.bfloat16 and build.bf16_rows:
        x = x.to(torch.bfloat16)
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()


def test_packing_puts_a_panel_of_output_columns_side_by_side_for_each_input_column():
    width = gemm_build().panel_width
    weight = torch.arange((width + 4) * 3, dtype=torch.float32).view(width + 4, 3)
    panels = pack(weight)
    assert panels.shape == (2, 3, width)
    assert torch.equal(panels[0, 1], weight[:width, 1])
    assert torch.equal(panels[1, 2, :4], weight[width:, 2]) and not panels[1, :, 4:].any()  # zeros past N


def test_bfloat16_panels_hold_each_column_k_and_k_plus_one_side_by_side_an_odd_k_padded_with_zero():
    width = gemm_build().panel_width
    weight = torch.randn(width, 5).to(torch.bfloat16)
    panels = pack(weight)
    assert panels.shape == (1, 3, width, 2)
    assert torch.equal(panels[0, 1, :, 0], weight[:, 2]) and torch.equal(panels[0, 1, :, 1], weight[:, 3])
    assert torch.equal(panels[0, 2, :, 0], weight[:, 4]) and not panels[0, 2, :, 1].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 48, 49, 300, 1030])
@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_the_packed_kernel_matches_f_linear(dtype, rows, out_features, in_features, bias):
    build = gemm_build()
    weight = (torch.randn(out_features, in_features) * 0.2).to(dtype)
    b = torch.randn(out_features) if bias else None
    x = torch.randn(rows, in_features)
    out = gemm(x, pack(weight), out_features, b)
    torch.testing.assert_close(out, expected(x, weight, b, build), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # compiles every build afresh: `make test`, not the inner loop
@pytest.mark.parametrize("variant", native.runnable_variants())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_build_this_cpu_runs_gives_the_portable_builds_results(variant, dtype):
    """The instruction set is chosen at run time; each build must compute what the portable one does
    (to rounding). On a machine without AVX-512 an emulated build runs the AVX-512 layout and the
    bfloat16 dot product's arithmetic in AVX2, so that code is checked here too."""
    portable, build = gemm_build("portable"), gemm_build(variant)
    assert build is not None and build.variant == variant
    generator = torch.Generator().manual_seed(7)
    for rows, (out_features, in_features) in zip([1, 3, 7, 49, 1030, 1100], SHAPES + [(70, 600)]):
        weight = (torch.randn(out_features, in_features, generator=generator) * 0.2).to(dtype)
        x, b = torch.randn(rows, in_features, generator=generator), torch.randn(out_features, generator=generator)
        if dtype is torch.bfloat16 and build.bf16_rows:
            x = x.to(torch.bfloat16).float()  # the values both builds multiply
        out = gemm(x, pack(weight, build), out_features, b, build)
        reference = gemm(x, pack(weight, portable), out_features, b, portable)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, expected(x, weight, b, build), atol=1e-5, rtol=1e-5)


def test_paired_packing_puts_the_gate_and_the_up_panel_of_the_same_columns_side_by_side():
    width = gemm_build().panel_width
    halves = width + 3  # two pairs, the second partial
    weight = torch.arange(2 * halves * 2, dtype=torch.float32).view(2 * halves, 2)
    panels = pack(weight, halves=halves)
    assert panels.shape == (4, 2, width)
    gate, up = weight[:halves], weight[halves:]
    assert torch.equal(panels[0, 1], gate[:width, 1]) and torch.equal(panels[1, 1], up[:width, 1])
    assert torch.equal(panels[2, 0, :3], gate[width:, 0]) and torch.equal(panels[3, 0, :3], up[width:, 0])
    assert not panels[2:, :, 3:].any()  # zeros past each half's columns


# rows, halves, in features: a few rows over blocks of k (the last one partial) among them
GATED_SHAPES = [(1, 64, 8), (7, 100, 64), (16, 40, 300), (50, 33, 5), (300, 704, 96)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, halves, in_features", GATED_SHAPES)
def test_over_paired_panels_the_product_is_the_unpaired_one_bit_for_bit(
    dtype, threads, rows, halves, in_features, monkeypatch
):
    monkeypatch.setattr(native, "_threads", threads)
    monkeypatch.setattr(cpu_linear, "SPLIT_MACS", 0)
    weight, bias = (torch.randn(2 * halves, in_features) * 0.2).to(dtype), torch.randn(2 * halves)
    x = torch.randn(rows, in_features)
    unpaired = gemm(x, pack(weight), 2 * halves, bias)
    assert torch.equal(gemm(x, pack(weight, halves=halves), 2 * halves, bias, halves=halves), unpaired)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, halves, in_features", GATED_SHAPES)
def test_the_gated_product_is_the_product_then_the_activation(
    dtype, out_dtype, threads, rows, halves, in_features, monkeypatch
):
    """SiLU(gate) * up applied as the sums are stored gives what the product and then the activation
    kernel give: float32 rows, or bfloat16 rows rounded as that kernel rounds them."""
    monkeypatch.setattr(native, "_threads", threads)
    monkeypatch.setattr(cpu_linear, "SPLIT_MACS", 0)
    weight, bias = (torch.randn(2 * halves, in_features) * 0.2).to(dtype), torch.randn(2 * halves)
    x = torch.randn(rows, in_features)
    apart = silu_and_mul(gemm(x, pack(weight), 2 * halves, bias), halves, bf16_rows=out_dtype is torch.bfloat16)
    out = torch.full((rows, halves), float("nan"), dtype=out_dtype)
    gated = gated_gemm(x, pack(weight, halves=halves), halves, bias, out)
    assert gated is out
    torch.testing.assert_close(gated, apart, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_gated_product_whose_gates_fall_far_below_zero_gives_no_nan(out_dtype):
    """A gate of -100 (e^100 overflows float32) is SiLU -0, not NaN, as the product stores it."""
    weight = torch.zeros(2 * 32, 16)
    weight[:32, 0] = -100.0 - torch.arange(32)  # the gates
    weight[32:, 0] = 1.0  # the ups
    x = torch.zeros(3, 16)
    x[:, 0] = 1.0
    out = torch.empty((3, 32), dtype=out_dtype)
    gated = gated_gemm(x, pack(weight, halves=32), 32, None, out)
    assert gated is not None and not torch.isnan(gated.float()).any()
    assert (gated.float().abs() < 1e-30).all()


@pytest.mark.slow  # compiles every build afresh: `make test`, not the inner loop
@pytest.mark.parametrize("variant", native.runnable_variants())
def test_every_build_gates_as_the_portable_one(variant):
    portable, build = gemm_build("portable"), gemm_build(variant)
    generator = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        weight = (torch.randn(2 * 70, 96, generator=generator) * 0.2).to(dtype)
        x = torch.randn(13, 96, generator=generator)
        if dtype is torch.bfloat16 and build.bf16_rows:
            x = x.to(torch.bfloat16).float()  # the values both builds multiply
        out, reference = torch.empty(13, 70), torch.empty(13, 70)
        gated_gemm(x, pack(weight, build, halves=70), 70, None, out, build)
        gated_gemm(x, pack(weight, portable, halves=70), 70, None, reference, portable)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_the_tests_reach_the_avx512_layout_and_the_dot_product_on_every_x86_machine():
    variants = native.runnable_variants()
    if "avx2" not in native.cpu_flags():
        pytest.skip("not an x86-64 machine with AVX2")
    wide = [gemm_build(v) for v in variants if gemm_build(v).panel_width == 32]
    assert any(build.bf16_rows for build in wide), variants


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_sums_do_not_depend_on_how_many_rows_share_the_call(dtype, threads, monkeypatch):
    """A decode's few rows pass a panel block of k by block, a prompt's many pass it whole: each row still
    adds its products in the same order, so every row count gives the same bits (and a batch's tokens do not
    depend on what runs beside them)."""
    monkeypatch.setattr(native, "_threads", threads)
    weight, bias = (torch.randn(70, 600) * 0.1).to(dtype), torch.randn(70)  # a partial panel; k in several blocks
    x, panels = torch.randn(300, 600), pack(weight)
    many = gemm(x, panels, 70, bias)
    for rows in (1, 2, 3, 5, 16, 31, 32, 33, 48):
        assert torch.equal(gemm(x[:rows], panels, 70, bias), many[:rows]), rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_call_of_no_rows_gives_no_rows(dtype):
    weight = torch.randn(70, 64).to(dtype)
    assert gemm(torch.randn(0, 64), pack(weight), 70, None).shape == (0, 70)
    out = torch.empty(0, 35)
    assert gated_gemm(torch.randn(0, 64), pack(weight, halves=35), 35, None, out) is out


def test_rows_of_a_wider_tensor_are_read_in_place():
    weight = torch.randn(40, 32)
    wide = torch.randn(9, 96)
    x = wide[:, 32:64]  # a view whose rows are 96 floats apart, as a split of a fused projection
    torch.testing.assert_close(gemm(x, pack(weight), 40, None), F.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [2, 3])
def test_split_over_threads_the_result_is_the_same_bit_for_bit(dtype, threads, monkeypatch):
    weight, x = torch.randn(200, 64).to(dtype), torch.randn(12, 64)
    one = gemm(x, pack(weight), 200, None)
    monkeypatch.setattr(cpu_linear, "SPLIT_MACS", 0)
    monkeypatch.setattr(cpu_linear, "SPLIT_ROWS", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        split = gemm(x, pack(weight), 200, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(split, one)


def test_a_call_is_shared_when_its_rows_are_many_enough_or_its_weight_large_enough(monkeypatch):
    shared = []
    real_share_units = native.share_units
    monkeypatch.setattr(
        native,
        "share_units",
        lambda kernel, args, units, worth_sharing, per_thread: (
            shared.append(worth_sharing) or real_share_units(kernel, args, units, worth_sharing, per_thread)
        ),
    )
    monkeypatch.setattr(native, "_threads", 2)
    small, large = torch.randn(256, 256), torch.randn(4096, 256)  # 256 KiB and 4 MiB of float32
    for weight, rows in ((small, 1), (small, 3), (small, 32), (large, 1), (large.to(torch.bfloat16), 1)):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(
            gemm(x, pack(weight), weight.shape[0], None), expected(x, weight, None, gemm_build()), atol=1e-4, rtol=1e-4
        )
    # A few rows against a small weight are one thread's: a helper costs more than it brings. Many
    # rows are arithmetic, and one row against a large weight is bound by reading it: both shared,
    # by its bytes, so the same weight in bfloat16 (half the bytes) is one thread's.
    assert shared == [False, False, True, True, False]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_layer_packs_its_weight_on_a_cpu_and_computes_in_float32(dtype):
    layer = Linear(32, 24).to(dtype)
    layer.bias.data = layer.bias.data.float()  # as the loader leaves a half model's biases
    prepare_layers(layer, torch.float32)
    assert layer.panels is not None and layer.panels.dtype is dtype
    x = torch.randn(5, 32)
    out = layer(x)
    assert out.dtype is torch.float32
    torch.testing.assert_close(out, expected(x, layer.weight, layer.bias, gemm_build()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_layer_takes_bf16_rows_exactly_where_its_kernel_rounds_x_to_them_and_gives_the_same_result(dtype):
    layer = Linear(32, 24).to(dtype)
    layer.bias.data = layer.bias.data.float()
    prepare_layers(layer, torch.float32)
    assert layer.takes_bf16_rows == (dtype is torch.bfloat16 and gemm_build().bf16_rows)
    odd = Linear(31, 24).to(dtype)
    prepare_layers(odd, torch.float32)
    assert not odd.takes_bf16_rows  # the dot product takes pairs: an odd width is padded by the kernel's caller
    x = torch.randn(7, 32)
    if layer.takes_bf16_rows:
        assert torch.equal(layer(x.to(torch.bfloat16)), layer(x))


def test_a_row_parallel_product_leaves_the_bias_to_be_added_after_the_all_reduce():
    layer = Linear(32, 24)
    prepare_layers(layer, torch.float32)
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer.product(x, None), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


def test_without_a_kernel_a_half_weight_still_serves_float32_rows(monkeypatch):
    monkeypatch.setattr(cpu_linear, "gemm_build", lambda variant=None: None)
    layer = Linear(16, 8).to(torch.bfloat16)
    prepare_layers(layer, torch.float32)
    assert layer.panels is None
    x = torch.randn(2, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight.float(), layer.bias.float()))


def test_a_layer_with_an_output_slot_writes_large_outputs_into_one_buffer_and_others_afresh():
    layer = Linear(256, 1024)
    layer.prepare(torch.float32)
    layer.output_slot = "a test's projection"
    large = [torch.randn(300, 256) for _ in range(2)]  # 300 x 1,024 floats: past the reuse threshold
    outputs = [layer(x) for x in large]
    for x, out in zip(large[1:], outputs[1:]):
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert outputs[0].data_ptr() == outputs[1].data_ptr()  # the first is spent once the second is taken
    assert layer(torch.randn(2, 256)).data_ptr() != outputs[1].data_ptr()  # small: its own tensor
    layer.output_slot = None
    assert layer(large[0]).data_ptr() != outputs[1].data_ptr()


@pytest.fixture
def prompt_products(kernels_chosen):
    """Who multiplies a prompt's rows, forced within the test (a worker's --prompt-products)."""
    cpu_linear._by_tiles.cache_clear()
    yield lambda route: kernels_chosen(prompt_products=route)
    cpu_linear._by_tiles.cache_clear()


def test_prompt_products_go_to_onednn_where_the_cpu_has_amx_tiles_for_bfloat16(prompt_products, monkeypatch):
    has_tiles = "amx_bf16" in native.cpu_flags() and torch.backends.mkldnn.is_available()
    assert cpu_linear.prompt_products() == ("onednn" if has_tiles else "native")
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    cpu_linear._by_tiles.cache_clear()
    assert cpu_linear.prompt_products() == ("onednn" if torch.backends.mkldnn.is_available() else "native")
    assert "by oneDNN" in cpu_linear.describe_products(torch.bfloat16) or not torch.backends.mkldnn.is_available()
    assert cpu_linear.describe_products(torch.float32) == ""


@pytest.mark.parametrize("bias", [True, False])
def test_a_prompts_bfloat16_product_by_onednn_is_torchs_and_a_decodes_stays_packed(prompt_products, bias):
    prompt_products("onednn")
    layer = Linear(96, 80, bias=bias).to(torch.bfloat16)
    if bias:
        layer.bias.data = layer.bias.data.float()
    prepare_layers(layer, torch.float32)
    rows = cpu_linear.PROMPT_ROWS
    with torch.no_grad():
        prompt, decode = torch.randn(rows, 96), torch.randn(rows - 1, 96)
        wanted = F.linear(prompt.bfloat16(), layer.weight).float() + (layer.bias if bias else 0)
        assert torch.equal(layer(prompt), wanted)
        assert layer.gated(prompt, False) is None  # a gated layer's activation then comes apart
        packed = gemm(decode, layer.panels, 80, layer.bias)
        assert torch.equal(layer(decode), packed)


def test_a_product_by_onednn_gets_a_torch_thread_per_kernel_thread_for_its_duration(prompt_products, monkeypatch):
    # The worker keeps torch at one thread while other processes use the cores; the packed kernel's helpers
    # and a prompt's product by oneDNN take every core.
    prompt_products("onednn")
    monkeypatch.setattr(native, "_threads", 2)
    layer = Linear(32, 16, bias=False).to(torch.bfloat16)
    prepare_layers(layer, torch.float32)
    seen = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: seen.append(torch.get_num_threads()) or linear(x, w, b))
    kept = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer(torch.randn(cpu_linear.PROMPT_ROWS, 32))
        assert seen == [2] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(kept)
