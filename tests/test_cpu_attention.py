"""The CPU attention paths, the compiled C kernel and vectorized torch, against the per-sequence
reference over the kernel tests' shapes."""

import math

import pytest
import torch

from kernels import cpu_attention, kv_quant, native
from kernels.batch import PagedBatch
from kernels.cpu_attention import (
    Workspace,
    native_accepts,
    native_kernel,
    paged_attention_native,
    paged_attention_torch,
)
from tests.test_kernels import ATTENTION_CASES, TOLERANCE, make_batch, reference_in_float32


def compiled_kernel():
    if native_kernel() is None:
        pytest.skip("no C compiler here: the compiled CPU attention kernel cannot be built")


@pytest.mark.parametrize("shapes, heads, kv_heads, head_dim, block_size, dtype", ATTENTION_CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_torch_cpu_attention_matches_reference(shapes, heads, kv_heads, head_dim, block_size, dtype, window):
    query, key_cache, value_cache, batch = make_batch(shapes, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = paged_attention_torch(query, key_cache, value_cache, batch, scale, window)
    expected = reference_in_float32(query, key_cache, value_cache, batch, scale, window)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


FLOAT32_CASES = [case for case in ATTENTION_CASES if case[-1] == torch.float32] + [
    ([(5, 18), (1, 40)], 8, 1, 128, 32, torch.float32)  # the other head size compiled on its own
]


@pytest.mark.parametrize("shapes, heads, kv_heads, head_dim, block_size, dtype", FLOAT32_CASES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("threads", [1, 3])
def test_compiled_cpu_attention_matches_reference(
    shapes, heads, kv_heads, head_dim, block_size, dtype, window, threads
):
    compiled_kernel()
    query, key_cache, value_cache, batch = make_batch(shapes, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_attention_native(query, key_cache, value_cache, batch, scale, window)
    finally:
        torch.set_num_threads(before)
    expected = reference_in_float32(query, key_cache, value_cache, batch, scale, window)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shapes, heads, kv_heads, head_dim, block_size, dtype", FLOAT32_CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_compiled_attention_over_a_half_cache_is_the_reference_over_its_values(
    shapes, heads, kv_heads, head_dim, block_size, dtype, window, storage
):
    # The CPU serves a bf16 or fp16 checkpoint with float32 queries over a cache of its own dtype.
    compiled_kernel()
    query, key_cache, value_cache, batch = make_batch(shapes, heads, kv_heads, head_dim, block_size, torch.float32)
    keys, values = key_cache.to(storage), value_cache.to(storage)
    assert native_accepts(query, keys, values)
    out = paged_attention_native(query, keys, values, batch, head_dim**-0.5, window)
    expected = reference_in_float32(query, keys, values, batch, head_dim**-0.5, window)
    # With the bfloat16 dot product a row's query and weights are rounded to bfloat16 (each weight within 2^-9 of
    # its own): the next test holds the rows to that rounding exactly.
    tolerance = 2e-2 if storage is torch.bfloat16 and cpu_attention.bf16_dot() else 1e-4
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    "storage", [torch.float32, torch.bfloat16, torch.int8, torch.uint8], ids=["f32", "bf16", "int8", "fp8"]
)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_rows_long_and_short_in_turn_are_the_reference(storage, group, threads, monkeypatch):
    # A row whose values fit in half a core's second-level cache asks for them while it reads its keys, and for the
    # next row's keys while it sums them; a longer one (9,000 tokens of 4 KV heads: past half of any such cache)
    # asks for its values a tile ahead. Rows of both kinds follow one another, in both orders. One-byte rows (int8,
    # E4M3: uint8 storage) are widened in registers on the same path: the reference reads their dequantized values.
    compiled_kernel()
    monkeypatch.setattr(native, "threads", lambda: threads)
    shapes = [(1, 40), (1, 9000), (1, 300), (1, 17), (1, 5000), (1, 1)]
    query, key_cache, value_cache, batch = make_batch(shapes, 4 * group, 4, 64, 16, torch.float32)
    if storage in (torch.int8, torch.uint8):
        keys, values = kv_quant.quantize(key_cache, storage), kv_quant.quantize(value_cache, storage)
        out = paged_attention_native(query, keys, values, batch, 64**-0.5)
        as_float = kv_quant.dequantize(keys, torch.float32), kv_quant.dequantize(values, torch.float32)
        torch.testing.assert_close(out, reference_in_float32(query, *as_float, batch, 64**-0.5), atol=1e-5, rtol=1e-5)
        return
    keys, values = key_cache.to(storage), value_cache.to(storage)
    out = paged_attention_native(query, keys, values, batch, 64**-0.5)
    if storage is torch.float32 or not cpu_attention.bf16_dot():
        expected = reference_in_float32(query, keys, values, batch, 64**-0.5)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        return
    for row, (_, context) in enumerate(shapes):
        expected, one_step = rounded_reference(query[row], keys, values, batch.block_tables[row], context, 64**-0.5)
        torch.testing.assert_close(out[row], expected, atol=max(3e-4, one_step), rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("storage", [torch.int8, torch.uint8], ids=["int8", "e4m3"])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, new", [(12, 4, 64, 45), (8, 2, 128, 45), (6, 3, 48, 45), (12, 4, 64, 20)]
)
def test_a_prompt_over_a_one_byte_cache_attends_as_its_decode_steps_did_to_the_bit(
    threads, storage, heads, kv_heads, head_dim, new, monkeypatch
):
    # A request recomputed after preemption runs its tokens again as one prompt (or a chunk over its cached prefix):
    # over an int8 or E4M3 cache each of its rows then gets exactly what the decode step that made it got, so that
    # its next token is the one it would have had.
    compiled_kernel()
    if "avx512f" not in native.cpu_flags():
        pytest.skip("builds without AVX-512 serve a one-byte cache's decode rows and prompt rows by different walks")
    monkeypatch.setattr(native, "threads", lambda: threads)
    context = 45
    query, key_cache, value_cache, batch = make_batch([(new, context)], heads, kv_heads, head_dim, 16, torch.float32)
    keys, values = kv_quant.quantize(key_cache, storage), kv_quant.quantize(value_cache, storage)
    prompt = paged_attention_native(query, keys, values, batch, head_dim**-0.5)
    table = batch.block_tables[0].tolist()
    one_a_step = PagedBatch.build(
        [0] * new, [table] * new, list(range(new + 1)), list(range(context - new + 1, context + 1)), torch.device("cpu")
    )
    assert torch.equal(prompt, paged_attention_native(query, keys, values, one_a_step, head_dim**-0.5))


def rounded_reference(query, keys, values, table, context, scale):
    """One query row, at position context - 1, over a bfloat16 cache as the dot product computes it: query and
    weights in bfloat16; and how far one weight next to a rounding boundary, rounded the other way (one bfloat16
    step of the largest weight), moves it."""
    heads, head_dim = query.shape
    block_size, kv_heads = keys.shape[1], keys.shape[2]
    blocks = table[: -(-context // block_size)].long()
    k = keys[blocks].reshape(-1, kv_heads, head_dim)[:context].float().repeat_interleave(heads // kv_heads, 1)
    v = values[blocks].reshape(-1, kv_heads, head_dim)[:context].float().repeat_interleave(heads // kv_heads, 1)
    weights = (torch.einsum("hd,thd->ht", query.bfloat16().float(), k) * scale).softmax(-1)
    step = 2.0 ** (torch.floor(torch.log2(weights.max())) - 7)
    return torch.einsum("ht,thd->hd", weights.bfloat16().float(), v), float(step * v.abs().max())


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim",
    [(12, 4, 64), (16, 2, 64), (8, 8, 128), (4, 2, 64), (4, 2, 80), (6, 3, 48), (4, 1, 112), (2, 2, 96)],
)
def test_rows_over_a_bf16_cache_take_their_query_and_weights_rounded_to_bf16(heads, kv_heads, head_dim):
    # Decode rows with contexts inside one run of 16 cached tokens, at its edges, across blocks and long; and a
    # prompt, a chunk over a cached prefix.
    compiled_kernel()
    if not cpu_attention.bf16_dot():
        pytest.skip("this build computes every row in float32: the test above covers it")
    shapes = [(1, context) for context in (1, 15, 16, 17, 33, 300)] + [(19, 19), (11, 40)]
    query, key_cache, value_cache, batch = make_batch(shapes, heads, kv_heads, head_dim, 32, torch.float32)
    keys, values = key_cache.bfloat16(), value_cache.bfloat16()
    out = paged_attention_native(query, keys, values, batch, head_dim**-0.5)
    row = 0
    for s, (queries, context) in enumerate(shapes):
        for position in range(context - queries, context):
            expected, one_step = rounded_reference(
                query[row], keys, values, batch.block_tables[s], position + 1, head_dim**-0.5
            )
            torch.testing.assert_close(out[row], expected, atol=max(3e-4, one_step), rtol=0)
            row += 1


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_rows_in_blocks_of_any_length_and_offset_are_the_reference(storage, window, threads):
    # A prompt's rows go QUERY_BLOCK at a time over keys laid out in tiles of 16 positions: chunks of every
    # length up to past two blocks, ending on and beside tile edges, alone or over a cached prefix; a group of
    # three heads (two scored together, then one); beside a decode row.
    compiled_kernel()
    shapes = [(2, 2), (8, 16), (9, 16), (16, 16), (17, 32), (23, 64), (1, 40)]
    query, key_cache, value_cache, batch = make_batch(shapes, 6, 2, 64, 16, torch.float32)
    keys, values = key_cache.to(storage), value_cache.to(storage)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_attention_native(query, keys, values, batch, 64**-0.5, window)
    finally:
        torch.set_num_threads(before)
    expected = reference_in_float32(query, keys, values, batch, 64**-0.5, window)
    tolerance = 2e-2 if storage is torch.bfloat16 and cpu_attention.bf16_dot() else TOLERANCE[torch.float32]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.slow  # compiles every build afresh: `make test`, not the inner loop
@pytest.mark.parametrize("variant", native.runnable_variants())
@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16, torch.float16, torch.int8], ids=str)
def test_every_build_this_cpu_runs_attends_as_the_portable_build_does(variant, storage, monkeypatch):
    # The instruction set is chosen at run time: each build computes what the portable one does, to rounding (a
    # build with the bfloat16 dot product rounds queries and weights over a bfloat16 cache, the test above).
    compiled_kernel()
    shapes = [(1, 17), (1, 300), (19, 19), (9, 40)]
    query, key_cache, value_cache, batch = make_batch(shapes, 12, 4, 64, 16, torch.float32)
    if storage is torch.int8:
        keys, values = kv_quant.quantize(key_cache, storage), kv_quant.quantize(value_cache, storage)
    else:
        keys, values = key_cache.to(storage), value_cache.to(storage)

    def attend(build: str) -> torch.Tensor:
        monkeypatch.setattr(cpu_attention, "native_kernel", lambda symbol: native_kernel(symbol, build))
        batch.derived.clear()
        return paged_attention_native(query, keys, values, batch, 64**-0.5)

    portable, out = attend("portable"), attend(variant)
    tolerance = 2e-2 if storage is torch.bfloat16 and cpu_attention.bf16_dot(variant) else 1e-5
    torch.testing.assert_close(out, portable, atol=tolerance, rtol=tolerance)


QUANTIZED_CASES = ATTENTION_CASES + [
    ([(1, 37), (9, 40), (1, 3)], 4, 2, 64, 16, torch.float32)  # the shipped model's heads
]


@pytest.mark.parametrize("storage", [torch.int8, torch.uint8], ids=["int8", "fp8"])
@pytest.mark.parametrize("shapes, heads, kv_heads, head_dim, block_size, dtype", QUANTIZED_CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_compiled_attention_over_a_quantized_cache_is_the_reference_over_its_values(
    shapes, heads, kv_heads, head_dim, block_size, dtype, window, storage
):
    # One-query rows (decode, a chunk's ninth) at head size 64 with groups of 2 (and of 4, int8 only)
    # take whole vectors, every other row the tiled walk: these shapes reach both, with and without a window.
    compiled_kernel()
    query, key_cache, value_cache, batch = make_batch(shapes, heads, kv_heads, head_dim, block_size, torch.float32)
    keys, values = kv_quant.quantize(key_cache, storage), kv_quant.quantize(value_cache, storage)
    assert native_accepts(query, keys, values)
    out = paged_attention_native(query, keys, values, batch, head_dim**-0.5, window)
    expected = reference_in_float32(
        query,
        kv_quant.dequantize(keys, torch.float32),
        kv_quant.dequantize(values, torch.float32),
        batch,
        head_dim**-0.5,
        window,
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_the_compiled_kernel_reads_queries_in_place_from_a_fused_qkv_row():
    compiled_kernel()
    query, key_cache, value_cache, batch = make_batch([(3, 9), (1, 20)], 4, 2, 64, 8, torch.float32)
    tokens, heads, head_dim = query.shape
    rows = torch.randn(tokens, (heads + 2 * 2) * head_dim)  # q, k and v side by side, as the models make them
    rows[:, : heads * head_dim] = query.reshape(tokens, -1)
    strided = rows[:, : heads * head_dim].view(tokens, heads, head_dim)
    assert not strided.is_contiguous() and native_accepts(strided, key_cache, value_cache)
    out = paged_attention_native(strided, key_cache, value_cache, batch, head_dim**-0.5)
    torch.testing.assert_close(out, paged_attention_native(query, key_cache, value_cache, batch, head_dim**-0.5))


def test_a_large_output_is_written_into_one_buffer_that_the_next_call_takes_again():
    """A prefill's attention output is spent by the layer's output projection before the next layer
    attends: fresh pages for it every layer cost more than the attention (kernels/workspace.py)."""
    compiled_kernel()
    query, key_cache, value_cache, batch = make_batch([(300, 300), (300, 310)], 8, 2, 64, 16, torch.float32)
    workspace = Workspace()
    first = paged_attention_native(query, key_cache, value_cache, batch, 64**-0.5, workspace=workspace)
    expected = first.clone()
    second = paged_attention_native(query * 2, key_cache, value_cache, batch, 64**-0.5, workspace=workspace)
    assert second.data_ptr() == first.data_ptr() and not torch.equal(second, expected)
    small, _, _, small_batch = make_batch([(1, 9)], 8, 2, 64, 16, torch.float32)
    one_row = paged_attention_native(small, key_cache, value_cache, small_batch, 64**-0.5, workspace=workspace)
    assert one_row.data_ptr() != first.data_ptr()  # small: its own tensor


def test_the_compiled_kernel_takes_float32_queries_only_and_leaves_half_ones_to_torch():
    for dtype, taken in ((torch.float32, True), (torch.bfloat16, False), (torch.float16, False)):
        query, key_cache, value_cache, _ = make_batch([(1, 5)], 4, 2, 64, 8, dtype)
        assert native_accepts(query, key_cache, value_cache) is taken
        assert native_accepts(query.float(), key_cache, value_cache) is (native_kernel() is not None)


def test_sequences_are_split_over_threads_by_work_and_none_is_left_out():
    _, _, _, batch = make_batch([(1, 100), (30, 30), (1, 5), (1, 5), (1, 90), (1, 8)], 4, 2, 16, 8, torch.float32)
    parts = cpu_attention._split(batch.query_start_list, batch.context_lens_list, 3)
    assert len(parts) == 3 and parts[0][0] == 0 and parts[-1][1] == batch.num_seqs
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(parts, parts[1:]))
    _, _, _, even = make_batch([(1, 20)] * 6, 4, 2, 16, 8, torch.float32)
    assert cpu_attention._split(even.query_start_list, even.context_lens_list, 3) == [(0, 2), (2, 4), (4, 6)]
    assert cpu_attention._split(even.query_start_list, even.context_lens_list, 1) == [(0, 6)]


def test_a_long_prompt_among_few_is_cut_into_runs_of_whole_query_blocks_of_about_equal_work():
    _, _, _, batch = make_batch([(300, 340), (1, 50)], 4, 2, 16, 8, torch.float32)
    pieces = cpu_attention._pieces(batch.query_start_list, batch.context_lens_list, 8)
    prompt = [(first, end) for s, first, end in pieces if s == 0]
    assert len(prompt) > 4 and prompt[0][0] == 0 and prompt[-1][1] == 300 and (1, 0, 1) in pieces
    assert all(a[1] == b[0] and b[0] % cpu_attention.QUERY_BLOCK == 0 for a, b in zip(prompt, prompt[1:]))
    work = [cpu_attention._causal_work(340, 300, first, end) for first, end in prompt]
    assert max(work) < 2 * min(work)  # the later queries see more: their runs are shorter
    assert cpu_attention._pieces(batch.query_start_list, batch.context_lens_list, 1) == [(0, 0, 300), (1, 0, 1)]


@pytest.mark.parametrize("window", [None, 37])
def test_a_prompt_cut_between_threads_gets_the_answer_it_gets_whole(window, monkeypatch):
    compiled_kernel()
    query, key_cache, value_cache, batch = make_batch([(150, 170)], 4, 2, 64, 16, torch.float32)
    monkeypatch.setattr(cpu_attention.native, "_threads", 1)
    whole = paged_attention_native(query, key_cache, value_cache, batch, 0.125, window)
    batch.derived.clear()
    monkeypatch.setattr(cpu_attention.native, "_threads", 3)
    shared = paged_attention_native(query, key_cache, value_cache, batch, 0.125, window)
    assert len(batch.derived["native"].starts) > 2  # the prompt went as several runs
    assert torch.equal(shared, whole)
    expected = reference_in_float32(query, key_cache, value_cache, batch, 0.125, window)
    torch.testing.assert_close(shared, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_a_lone_decode_row_is_cut_by_kv_heads_between_the_threads_and_a_prompt_or_a_full_batch_is_not():
    assert cpu_attention.head_slices([0, 1], 2) == 2
    assert cpu_attention.head_slices([0, 1], 1) == 1
    assert cpu_attention.head_slices([0, 1, 2], 2) == 1  # a row for each thread already
    assert cpu_attention.head_slices([0, 7], 2) == 1  # a prompt: its runs of queries are the threads' shares


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize(
    "storage",
    [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8],
    ids=["f32", "bf16", "f16", "int8", "fp8"],
)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, threads", [(12, 4, 64, 2), (8, 2, 128, 3), (6, 3, 48, 2), (4, 4, 80, 3)]
)
def test_a_lone_decode_row_shared_by_kv_heads_gets_the_answer_it_gets_whole(
    storage, heads, kv_heads, head_dim, threads, window, monkeypatch
):
    compiled_kernel()
    query, key_cache, value_cache, batch = make_batch([(1, 700)], heads, kv_heads, head_dim, 16, torch.float32)
    if storage in (torch.int8, torch.uint8):
        keys, values = kv_quant.quantize(key_cache, storage), kv_quant.quantize(value_cache, storage)
    else:
        keys, values = key_cache.to(storage), value_cache.to(storage)
    monkeypatch.setattr(cpu_attention.native, "_threads", 1)
    whole = paged_attention_native(query, keys, values, batch, head_dim**-0.5, window).clone()
    batch.derived.clear()
    monkeypatch.setattr(cpu_attention.native, "_threads", threads)
    poisoned = Workspace()  # an output whose every value the call must write
    with poisoned.reusing_every_size():
        poisoned.take("attention output", tuple(query.shape), torch.float32, query.device).fill_(math.nan)
        shared = paged_attention_native(query, keys, values, batch, head_dim**-0.5, window, poisoned)
    assert batch.derived["native"].slices == threads  # the row went to every thread, a slice of its KV heads each
    assert torch.equal(shared, whole)


@pytest.mark.parametrize("attention", [paged_attention_torch, paged_attention_native])
def test_a_reused_workspace_gives_the_same_answers_for_batches_of_other_sizes(attention):
    if attention is paged_attention_native:
        compiled_kernel()
    workspace = Workspace()
    for seed, shapes in enumerate([[(1, 40)] * 6, [(1, 3), (1, 70)], [(1, 17)] * 9]):
        query, key_cache, value_cache, batch = make_batch(shapes, 4, 2, 64, 8, torch.float32, seed=seed)
        out = attention(query, key_cache, value_cache, batch, 0.125, workspace=workspace)
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
    query, key_cache, value_cache, batch = make_batch(
        [(1, 9), (1, 30), (1, 17), (1, 2), (1, 25)], 4, 2, 64, 8, torch.float32, seed=7
    )
    expected = reference_in_float32(query, key_cache, value_cache, batch, 0.125)
    for chunk_bytes in (1, 2 * 32 * 2 * 64 * 4 * 2, 1 << 30):  # one sequence, two, all
        monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", chunk_bytes)
        batch.derived.clear()
        out = paged_attention_torch(query, key_cache, value_cache, batch, 0.125, workspace=Workspace())
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.slow  # runs the compiler twice from scratch: not in `make check`
def test_a_kernel_is_built_into_a_directory_only_its_user_can_write(tmp_path, monkeypatch):
    from kernels import native

    # The smallest kernel: every one is built by the same code.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("cpu_activation") is not None
    directory = tmp_path / "pagedserve" / "kernels"
    assert directory.stat().st_mode & 0o777 == 0o700 and len(list(directory.glob("cpu_activation-*.so"))) == 1

    directory.chmod(0o777)  # anyone could plant a library here: build privately and leave nothing
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("cpu_activation") is not None
    assert len(list(directory.glob("cpu_activation-*.so"))) == 1


def test_without_a_compiler_the_kernel_is_not_built_and_torch_serves(monkeypatch):
    from kernels import native

    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("cpu_attention") is None


def test_loading_the_kernel_leaves_subnormal_numbers_alone():
    compiled_kernel()  # linked with -ffast-math, a library would set flush-to-zero for the whole process
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0


def rotary_inputs(generator, tokens, heads, kv_heads, head_dim, scale=1.0):
    """A step's queries, keys and values, and the cos and sin of angles up to 50 radians."""
    query = torch.randn(tokens, heads, head_dim, generator=generator)
    key, value = (torch.randn(tokens, kv_heads, head_dim, generator=generator) * scale for _ in range(2))
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 50
    return query, key, value, torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()


def assert_rotary_and_write_are_the_reference(query, key, value, cos, sin, caches, slots):
    """The compiled rotary and cache write (into caches[0], caches[1]) bit for bit torch's (into the other two)."""
    from kernels.kv_write import write_kv_reference
    from kernels.rotary import apply_rope, rotate_and_write_native

    rotated = query.clone()
    assert rotate_and_write_native(rotated, key, value, cos, sin, caches[0], caches[1], slots)
    write_kv_reference(apply_rope(key, cos, sin), value, caches[2], caches[3], slots)
    assert torch.equal(rotated, apply_rope(query, cos, sin))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (8, 1, 128), (3, 3, 16)])
def test_compiled_rotary_and_kv_write_are_bit_for_bit_the_torch_reference(heads, kv_heads, head_dim):
    from kernels.rotary import native_kernel as rotary_kernel
    from kernels.rotary import rotate_and_write_native

    if rotary_kernel() is None:
        pytest.skip("no C compiler here: the compiled rotary kernel cannot be built")
    generator = torch.Generator().manual_seed(heads)
    tokens, block_size, num_blocks = 7, 4, 5
    query, key, value, cos, sin = rotary_inputs(generator, tokens, heads, kv_heads, head_dim)
    slots = torch.tensor([3, 9, -1, 0, 17, 12, 5])
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim) for _ in range(4)]

    assert_rotary_and_write_are_the_reference(query, key, value, cos, sin, caches, slots)
    assert not rotate_and_write_native(
        query.half(), key.half(), value.half(), cos.half(), sin.half(), caches[0].half(), caches[1].half(), slots
    )  # float32 queries only


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_compiled_rotary_of_a_prompt_shared_between_threads_is_the_torch_reference(storage, monkeypatch):
    from kernels.rotary import SPLIT_VALUES, SYMBOLS
    from kernels.rotary import native_kernel as rotary_kernel

    if rotary_kernel(SYMBOLS[storage]) is None:
        pytest.skip("no C compiler here: the compiled rotary kernel cannot be built")
    monkeypatch.setattr(native, "_threads", 2)
    generator = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, head_dim = 600, 8, 2, 64
    assert tokens * (heads + 2 * kv_heads) * head_dim >= SPLIT_VALUES  # shared
    query, key, value, cos, sin = rotary_inputs(generator, tokens, heads, kv_heads, head_dim)
    slots = torch.randperm(700, generator=generator)[:tokens]
    caches = [torch.zeros(175, 4, kv_heads, head_dim, dtype=storage) for _ in range(4)]
    assert_rotary_and_write_are_the_reference(query, key, value, cos, sin, caches, slots)


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_compiled_rotary_writes_a_half_cache_rounded_as_torch_rounds(storage):
    from kernels.rotary import SYMBOLS
    from kernels.rotary import native_kernel as rotary_kernel

    if rotary_kernel(SYMBOLS[storage]) is None:
        pytest.skip("no C compiler here: the compiled rotary kernel cannot be built")
    generator = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 64
    query, key, value, cos, sin = rotary_inputs(generator, tokens, heads, kv_heads, head_dim, scale=100)
    value[0, 0, :3] = torch.tensor([float("inf"), 3e38, 1e-30])  # out of float16's range, and below it
    slots = torch.tensor([3, 9, -1, 0, 17, 12])
    caches = [torch.zeros(5, 4, kv_heads, head_dim, dtype=storage) for _ in range(4)]
    assert_rotary_and_write_are_the_reference(query, key, value, cos, sin, caches, slots)


class GuardedOutput(Workspace):
    """A workspace whose attention output is followed by a run of sentinel values."""

    SENTINEL, GUARD = 12345.0, 4096

    def take_if_large(self, name, shape, dtype, device):
        if name != "attention output":
            return super().take_if_large(name, shape, dtype, device)
        size = math.prod(shape)
        self.whole = torch.full((size + self.GUARD,), self.SENTINEL, dtype=dtype, device=device)
        return self.whole[:size].view(shape)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 80), (6, 3, 48), (4, 1, 112), (3, 3, 16)])
def test_bf16_rows_at_head_sizes_of_half_vectors_write_nothing_past_their_output(heads, kv_heads, head_dim):
    # A head's last 16 dimensions are half a vector: the kernel stores 16 sums there, not 32.
    compiled_kernel()
    shapes = [(1, 17), (1, 300), (19, 19), (11, 40)]
    query, key_cache, value_cache, batch = make_batch(shapes, heads, kv_heads, head_dim, 32, torch.float32)
    workspace = GuardedOutput()
    out = paged_attention_native(
        query, key_cache.bfloat16(), value_cache.bfloat16(), batch, head_dim**-0.5, workspace=workspace
    )
    assert torch.isfinite(out).all()
    assert (workspace.whole[out.numel() :] == GuardedOutput.SENTINEL).all()


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(12, 4, 64), (6, 2, 128), (5, 5, 64), (6, 2, 96), (4, 4, 32), (2, 1, 256)]
)
@pytest.mark.parametrize("window", [None, 50])
def test_prompt_blocks_in_amx_tiles_are_the_dot_products_rows_summed_in_another_order(
    heads, kv_heads, head_dim, window
):
    # Where the CPU has AMX tiles for bfloat16, a prompt's blocks over a bfloat16 cache take them from a multiple
    # of 32 positions: chunks ending on and beside such edges, over cached prefixes, groups of one to three heads,
    # odd contexts, a sliding window, beside a decode row. The same rounding of queries and weights as the vector
    # dot product's, so the rows differ only where a sum's order moves a weight across a bfloat16 rounding.
    compiled_kernel()
    if not cpu_attention.use_tiles(True):
        pytest.skip("no AMX tiles for bfloat16 here (or no bfloat16 dot product in this build)")
    shapes = [(2, 2), (31, 31), (33, 33), (64, 64), (9, 77), (40, 300), (1, 40), (100, 129)]
    query, key_cache, value_cache, batch = make_batch(shapes, heads, kv_heads, head_dim, 16, torch.float32)
    keys, values = key_cache.bfloat16(), value_cache.bfloat16()

    def attend(tiles: bool) -> torch.Tensor:
        assert cpu_attention.use_tiles(tiles) == tiles
        batch.derived.clear()
        return paged_attention_native(query, keys, values, batch, head_dim**-0.5, window).clone()

    try:
        vector, tiles = attend(False), attend(True)
    finally:
        cpu_attention.use_tiles(True)
    assert not tiles.isnan().any()
    torch.testing.assert_close(tiles, vector, atol=2e-3, rtol=0)
    expected = reference_in_float32(query, keys, values, batch, head_dim**-0.5, window)
    torch.testing.assert_close(tiles, expected, atol=2e-2, rtol=2e-2)
