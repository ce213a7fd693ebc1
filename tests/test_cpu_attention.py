"""The vectorized CPU attention against the per-sequence reference, over the kernel tests' shapes."""

import pytest
import torch

from kernels.cpu_attention import Workspace, paged_attention_cpu
from tests.test_kernels import ATTENTION_CASES, TOLERANCE, make_batch, reference_in_float32


@pytest.mark.parametrize("shapes, heads, kv_heads, head_dim, block_size, dtype", ATTENTION_CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_cpu_attention_matches_reference(shapes, heads, kv_heads, head_dim, block_size, dtype, window):
    query, key_cache, value_cache, batch = make_batch(shapes, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = paged_attention_cpu(query, key_cache, value_cache, batch, scale, window)
    expected = reference_in_float32(query, key_cache, value_cache, batch, scale, window)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_reused_workspace_gives_the_same_answers_for_batches_of_other_sizes():
    workspace = Workspace()
    for seed, shapes in enumerate([[(1, 40)] * 6, [(1, 3), (1, 70)], [(1, 17)] * 9]):
        query, key_cache, value_cache, batch = make_batch(shapes, 4, 2, 64, 8, torch.float32, seed=seed)
        out = paged_attention_cpu(query, key_cache, value_cache, batch, 0.125, workspace=workspace)
        expected = reference_in_float32(query, key_cache, value_cache, batch, 0.125)
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)


def test_indexed_kv_write_matches_the_reference():
    from kernels.kv_write import write_kv_indexed, write_kv_reference

    generator = torch.Generator().manual_seed(4)
    key, value = torch.randn(5, 2, 8, generator=generator), torch.randn(5, 2, 8, generator=generator)
    for slots in ([7, 0, 13, 2, 9], [7, -1, 13, -1, 9]):
        slots = torch.tensor(slots)
        caches = [torch.zeros(4, 4, 2, 8) for _ in range(4)]
        write_kv_indexed(key, value, caches[0], caches[1], slots)
        write_kv_reference(key, value, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_decode_attention_in_chunks_of_any_size_matches_the_reference(monkeypatch):
    import kernels.cpu_attention as cpu_attention

    query, key_cache, value_cache, batch = make_batch([(1, 9), (1, 30), (1, 17), (1, 2), (1, 25)], 4, 2, 64, 8,
                                                      torch.float32, seed=7)
    expected = reference_in_float32(query, key_cache, value_cache, batch, 0.125)
    for chunk_bytes in (1, 2 * 32 * 2 * 64 * 4 * 2, 1 << 30):  # one sequence, two, all
        monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", chunk_bytes)
        batch.derived.clear()
        out = paged_attention_cpu(query, key_cache, value_cache, batch, 0.125, workspace=Workspace())
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)
