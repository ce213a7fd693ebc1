"""The CPU linear kernels against `F.linear`: the packed-panel kernel for batches of rows (decode
steps), split over threads or not, and the layer that picks it."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear, native
from kernels.cpu_linear import GEMM_MAX_ROWS, Linear, gemm, gemm_kernel, pack, pack_weights


@pytest.fixture(autouse=True)
def compiled_kernel():
    if gemm_kernel() is None:
        pytest.skip("no C compiler or no AVX2 here: the packed linear kernel cannot be built")
    with torch.inference_mode():
        yield


def test_packing_puts_sixteen_output_columns_side_by_side_for_each_input_column():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = pack(weight)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[0, 1], weight[:16, 1])
    assert torch.equal(panels[1, 2, :4], weight[16:, 2]) and not panels[1, :, 4:].any()  # zeros past N


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 48, 49, GEMM_MAX_ROWS])
@pytest.mark.parametrize("out_features, in_features", [(37, 100), (64, 256), (50, 13)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_packed_kernel_matches_f_linear(rows, out_features, in_features, bias):
    layer = Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)
    expected = F.linear(x, layer.weight, layer.bias)
    out = gemm(x, pack(layer.weight), out_features, layer.bias)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rows_of_a_wider_tensor_are_read_in_place():
    weight = torch.randn(40, 32)
    wide = torch.randn(9, 96)
    x = wide[:, 32:64]  # a view whose rows are 96 floats apart, as a split of a fused projection
    torch.testing.assert_close(gemm(x, pack(weight), 40, None), F.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
def test_split_over_threads_the_result_is_the_same_bit_for_bit(threads, monkeypatch):
    weight, x = torch.randn(200, 64), torch.randn(12, 64)
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
    real_share = native.share
    monkeypatch.setattr(native, "share", lambda run, count, label: shared.append(count) or real_share(run, count, label))
    monkeypatch.setattr(native, "_threads", 2)
    small, large = torch.randn(256, 256), torch.randn(4096, 256)  # 64 Ki and 1 Mi parameters
    for weight, rows in ((small, 1), (small, 3), (small, 32), (large, 1)):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(gemm(x, pack(weight), weight.shape[0], None), F.linear(x, weight),
                                   atol=1e-4, rtol=1e-4)
    # A few rows against a small weight are one thread's: a helper costs more than it brings. Many
    # rows are arithmetic, and one row against a large weight is bound by reading it: both shared.
    assert shared == [1, 1, 2, 2]


def test_a_packed_layer_uses_the_kernel_up_to_its_row_limit_and_torch_past_it(monkeypatch):
    layer = Linear(32, 24)
    pack_weights(layer)
    assert layer.panels is not None
    past = torch.randn(GEMM_MAX_ROWS + 1, 32)
    assert gemm(past, layer.panels, 24, layer.bias) is None
    torch.testing.assert_close(layer(past), F.linear(past, layer.weight, layer.bias))
    calls = []
    monkeypatch.setattr(cpu_linear, "gemm", lambda x, *rest: calls.append(x.shape[0]))  # declines: torch serves
    for rows in (3, GEMM_MAX_ROWS):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == [3, GEMM_MAX_ROWS]


def test_only_float32_weights_on_a_cpu_are_packed():
    layer = Linear(32, 24).to(torch.float16)
    layer.pack()
    assert layer.panels is None
