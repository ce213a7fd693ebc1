"""The compiled RMSNorm: shared between threads row by row, and writing a large output into the
step's buffer of its role where the model gives it one."""

import pytest
import torch

from kernels import cpu_norm, native
from kernels.workspace import step_scratch

pytestmark = pytest.mark.skipif(cpu_norm.native_kernel() is None, reason="no C compiler here")


@pytest.mark.parametrize("with_residual", [False, True])
def test_a_norm_shared_between_threads_gets_the_bits_one_thread_gets(with_residual, monkeypatch):
    x, weight = torch.randn(300, 512), torch.rand(512) + 0.5  # past SPLIT_VALUES: shared
    residuals = [torch.randn(300, 512) for _ in range(2)] if with_residual else [None, None]
    if with_residual:
        residuals[1].copy_(residuals[0])
    results = []
    for threads, residual in zip((1, 2), residuals):
        monkeypatch.setattr(native, "_threads", threads)
        with torch.no_grad():
            results.append(cpu_norm.rms_norm(x, weight, 1e-5, residual))
    assert torch.equal(results[0], results[1])
    if with_residual:
        assert torch.equal(residuals[0], residuals[1])  # each row's residual add done once, whoever did it


def test_a_norm_with_an_output_slot_writes_large_outputs_into_one_buffer_and_small_ones_afresh():
    weight = torch.ones(768)
    with torch.no_grad():
        large = [
            cpu_norm.rms_norm(torch.randn(1024, 768), weight, 1e-5, output_slot="attention input") for _ in range(2)
        ]
        small = [cpu_norm.rms_norm(torch.randn(4, 768), weight, 1e-5, output_slot="attention input") for _ in range(2)]
        fresh = cpu_norm.rms_norm(torch.randn(1024, 768), weight, 1e-5)
    assert large[0].data_ptr() == large[1].data_ptr()
    assert (
        large[0].data_ptr()
        == step_scratch.take("attention input", (1024, 768), torch.float32, torch.device("cpu")).data_ptr()
    )
    assert small[0].data_ptr() != small[1].data_ptr()
    assert fresh.data_ptr() != large[0].data_ptr()


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_rows_are_the_float32_norm_rounded_as_torch_rounds_it(with_residual, threads, monkeypatch):
    """A product that takes bfloat16 rows gets from the norm exactly the rows it would round itself."""
    monkeypatch.setattr(native, "_threads", threads)
    x, weight = torch.randn(300, 512) * 3, torch.rand(512) + 0.5
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1 + 2**-8])  # NaN, infinities, a tie
    residual = torch.randn(300, 512) if with_residual else None
    with torch.no_grad():
        wanted = cpu_norm.rms_norm(x, weight, 1e-5, None if residual is None else residual.clone())
        rows = cpu_norm.rms_norm(x, weight, 1e-5, residual, bf16_rows=True)
    assert rows.dtype is torch.bfloat16
    assert torch.equal(rows.view(torch.int16)[1:], wanted.to(torch.bfloat16).view(torch.int16)[1:])
    if not with_residual:
        assert torch.isnan(rows[0]).all() or torch.equal(rows[0], wanted[0].to(torch.bfloat16))


@pytest.mark.parametrize("threads", [1, 2])
def test_each_head_of_a_projections_rows_is_normalized_where_it_lies(threads, monkeypatch):
    """Qwen3's norm of q's and k's heads, on views of the fused q/k/v rows: in place, each head on its own,
    torch's values; the rest of the rows (v) untouched."""
    monkeypatch.setattr(native, "_threads", threads)
    tokens, q_heads, kv_heads, head_dim = 300, 4, 2, 64  # past SPLIT_VALUES: shared
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim) * 3
    before = qkv.clone()
    weight = torch.rand(head_dim) + 0.5
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    with torch.no_grad():
        normalized = [cpu_norm.rms_norm_heads(view, weight, 1e-6) for view in (q, k)]
    assert [n.data_ptr() for n in normalized] == [q.data_ptr(), k.data_ptr()]  # in place
    wanted = torch.rms_norm(
        before[:, : (q_heads + kv_heads) * head_dim].view(tokens, -1, head_dim), (head_dim,), weight, 1e-6
    )
    torch.testing.assert_close(
        qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, -1, head_dim), wanted, rtol=1e-5, atol=1e-5
    )
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim :], before[:, (q_heads + kv_heads) * head_dim :])


def test_heads_that_the_kernel_cannot_take_are_normalized_by_torch_into_a_new_tensor():
    x, weight = torch.randn(5, 3, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    with torch.no_grad():
        out = cpu_norm.rms_norm_heads(x, weight, 1e-6)
    assert out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, torch.rms_norm(x, (8,), weight, 1e-6))
