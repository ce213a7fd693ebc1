"""A gated MLP's SiLU(gate) * up from its fused gate_up rows: the compiled kernel, shared between
threads or not, against torch's two operations."""

import pytest
import torch
import torch.nn.functional as F

from kernels import native
from kernels.cpu_activation import native_kernel, silu_and_mul


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


def expected(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    return F.silu(gate_up[:, :width]) * gate_up[:, width:]


@pytest.mark.parametrize("rows, width", [(1, 8), (3, 704), (48, 704), (300, 256)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_matches_silu_times_up_on_one_thread_or_shared(rows, width, threads, monkeypatch):
    if native_kernel() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(native, "_threads", threads)
    gate_up = torch.randn(rows, 2 * width) * 4
    torch.testing.assert_close(silu_and_mul(gate_up.clone(), width), expected(gate_up, width), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bf16_rows", [False, True], ids=["float32", "bfloat16"])
def test_gates_far_below_zero_give_minus_zero_not_nan(bf16_rows):
    """Past -88, e^-gate overflows float32: SiLU is still -0 to its precision (torch's), not NaN."""
    if native_kernel() is None:
        pytest.skip("no C compiler here")
    gate_up = torch.randn(64, 2 * 256)
    gate_up[:, :256] = -torch.logspace(1.9, 4, 64 * 256).view(64, 256)  # -79 .. -10,000
    got = silu_and_mul(gate_up.clone(), 256, bf16_rows=bf16_rows).float()
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected(gate_up, 256), atol=1e-30, rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_rows_are_the_float32_result_rounded_as_torch_rounds_it_and_leave_gate_up_as_it_was(threads, monkeypatch):
    """A down projection that takes bfloat16 rows gets exactly the rows it would round itself."""
    if native_kernel("silu_mul_f32_bf16") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(native, "_threads", threads)
    gate_up = torch.randn(300, 2 * 704) * 4
    gate_up[0, 704] = float("nan")  # an up value: NaN stays NaN
    before = gate_up.clone()
    rows = silu_and_mul(gate_up, 704, bf16_rows=True)
    assert rows.dtype is torch.bfloat16
    assert torch.equal(gate_up.view(torch.int32), before.view(torch.int32))
    wanted = silu_and_mul(gate_up.clone(), 704).to(torch.bfloat16)
    assert torch.isnan(rows[0, 0])
    assert torch.equal(rows.view(torch.int16)[:, 1:], wanted.view(torch.int16)[:, 1:])
    assert torch.equal(rows.view(torch.int16)[1:], wanted.view(torch.int16)[1:])


def test_rows_of_a_wider_tensor_are_read_in_place_and_other_dtypes_go_to_torch():
    wide = torch.randn(5, 40)
    gate_up = wide[:, :32]  # rows 40 floats apart
    want = expected(gate_up, 16)
    torch.testing.assert_close(silu_and_mul(gate_up, 16), want, atol=1e-5, rtol=1e-5)
    half = torch.randn(4, 32).to(torch.bfloat16)
    torch.testing.assert_close(silu_and_mul(half.clone(), 16), expected(half, 16))


def test_the_result_is_written_over_the_gate_half_and_leaves_the_up_half_as_it_was():
    gate_up = torch.randn(48, 2 * 704)
    want, up = expected(gate_up, 704), gate_up[:, 704:].clone()
    out = silu_and_mul(gate_up, 704)
    assert out.data_ptr() == gate_up.data_ptr() and out.stride() == gate_up.stride()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(gate_up[:, 704:], up)
