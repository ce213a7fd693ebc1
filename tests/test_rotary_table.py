"""Rotary embeddings on a CPU: cos and sin looked up by position, with the values the formula gives."""

from types import SimpleNamespace

import torch

from services.worker.models.llama import TABLE_POSITIONS, RotaryEmbedding


def test_a_cpu_looks_cos_and_sin_up_by_position_as_the_formula_computes_them():
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), head_dim=64)
    positions = torch.tensor([0, 5, TABLE_POSITIONS - 1, 7])
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rotary.cos_sin(positions, dtype)
        want_cos, want_sin = rotary._computed(positions, dtype)
        assert cos.dtype is dtype and cos.shape == (4, 64)
        torch.testing.assert_close(cos, want_cos, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(sin, want_sin, atol=1e-6, rtol=1e-6)
    assert rotary._tables[torch.float32][0].shape[0] == TABLE_POSITIONS


def test_the_table_grows_by_doubling_once_a_position_passes_its_end():
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=500000.0), head_dim=32)
    rotary.cos_sin(torch.tensor([3]), torch.float32)
    far = torch.tensor([1, 3 * TABLE_POSITIONS + 5])
    cos, sin = rotary.cos_sin(far, torch.float32)
    assert rotary._tables[torch.float32][0].shape[0] == 4 * TABLE_POSITIONS
    want_cos, want_sin = rotary._computed(far, torch.float32)
    torch.testing.assert_close(cos, want_cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, want_sin, atol=1e-6, rtol=1e-6)
