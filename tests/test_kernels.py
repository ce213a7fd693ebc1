"""Every Triton kernel against its torch reference, over a table of shapes.

On a CPU these run under TRITON_INTERPRET=1 (set in conftest), so shapes stay small; on a GPU
the same tests run compiled, and a few larger cases are added.
"""

import random

import pytest
import torch
import triton  # noqa: F401  (installed with the test extra: these tests must run, never skip)

from kernels.batch import PagedBatch
from kernels.block_copy import copy_blocks_reference, copy_blocks_triton
from kernels.kv_write import write_kv_reference, write_kv_triton
from kernels.lora_triton import FIELDS, lora_add_triton
from kernels.norm_triton import rms_norm_triton
from kernels.paged_attention import paged_attention_reference, paged_attention_triton
from shared.lora import page_layout

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def make_batch(shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """shapes: (query_len, context_len) per sequence; blocks are handed out in shuffled order."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-ctx // block_size) for _, ctx in shapes]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    starts, slots = [0], []
    for (q_len, ctx), table in zip(shapes, tables):
        starts.append(starts[-1] + q_len)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    value_cache = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    query = torch.randn((starts[-1], num_heads, head_dim), generator=generator).to(dtype).to(DEVICE)
    batch = PagedBatch.build(slots, tables, starts, [ctx for _, ctx in shapes], DEVICE)
    return query, key_cache, value_cache, batch


def reference_in_float32(query, key_cache, value_cache, batch, scale, window=None):
    return paged_attention_reference(query.float(), key_cache.float(), value_cache.float(), batch, scale, window)


ATTENTION_CASES = [
    # (shapes, heads, kv_heads, head_dim, block_size, dtype)
    ([(1, 17), (1, 5), (1, 33)], 4, 4, 64, 16, torch.float32),  # decode, ragged, GQA 1
    ([(7, 7), (3, 20), (1, 9)], 8, 2, 64, 8, torch.float32),  # prefill + chunk + decode, GQA 4
    ([(5, 18), (1, 40)], 8, 1, 128, 32, torch.float16),  # MQA (GQA 8)
    ([(4, 4), (1, 12)], 5, 1, 64, 16, torch.float32),  # group of 5 heads
    ([(3, 11), (1, 26)], 4, 1, 80, 8, torch.float16),  # head size 80
    ([(2, 19), (1, 3)], 4, 2, 96, 16, torch.bfloat16),  # head size 96
    ([(6, 6), (1, 21)], 2, 2, 256, 16, torch.float32),  # head size 256
    ([(9, 30)], 4, 4, 128, 32, torch.bfloat16),  # chunk over a cached prefix
    ([(1, 1), (1, 2)], 4, 1, 64, 8, torch.float16),  # first tokens
]


@pytest.mark.parametrize("shapes, heads, kv_heads, head_dim, block_size, dtype", ATTENTION_CASES)
def test_paged_attention_matches_reference(shapes, heads, kv_heads, head_dim, block_size, dtype):
    query, key_cache, value_cache, batch = make_batch(shapes, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = paged_attention_triton(query, key_cache, value_cache, batch, scale)
    expected = reference_in_float32(query, key_cache, value_cache, batch, scale)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_tiles_of_32_keys_give_the_reference_too():
    """The tile benchmarks/kernel_bench.py times beside the kernel's choice."""
    shapes, heads, kv_heads, head_dim, block_size, dtype = ATTENTION_CASES[1]
    query, key_cache, value_cache, batch = make_batch(shapes, heads, kv_heads, head_dim, block_size, dtype)
    out = paged_attention_triton(query, key_cache, value_cache, batch, 0.125, block_n=32)
    expected = reference_in_float32(query, key_cache, value_cache, batch, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("window", [4, 9])
def test_sliding_window_attention_matches_reference(window):
    query, key_cache, value_cache, batch = make_batch([(6, 23), (1, 17), (4, 4)], 4, 2, 64, 8, torch.float32)
    out = paged_attention_triton(query, key_cache, value_cache, batch, 0.125, window)
    expected = reference_in_float32(query, key_cache, value_cache, batch, 0.125, window)
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_kv_decode_merges_to_the_same_result(num_splits):
    # Splits that end up empty (context 3 over 5 splits) must not disturb the merge.
    query, key_cache, value_cache, batch = make_batch([(1, 70), (1, 3), (1, 129)], 8, 2, 64, 16, torch.float32)
    out = paged_attention_triton(query, key_cache, value_cache, batch, 0.125, num_splits=num_splits)
    expected = reference_in_float32(query, key_cache, value_cache, batch, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)


def test_block_size_one_and_sixteen_agree():
    shapes = [(3, 21), (1, 14)]
    outs = []
    for block_size in (1, 16):
        query, key_cache, value_cache, batch = make_batch(shapes, 4, 2, 64, block_size, torch.float32, seed=3)
        # Same logical keys whatever the paging: copy them from a contiguous source.
        source = torch.randn((2, 21, 2, 64), generator=torch.Generator().manual_seed(9)).to(DEVICE)
        query = torch.randn(query.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
        for s, (_, ctx) in enumerate(shapes):
            for p in range(ctx):
                block = batch.block_tables[s, p // block_size]
                key_cache[block, p % block_size] = source[s, p]
                value_cache[block, p % block_size] = -source[s, p]
        outs.append(paged_attention_triton(query, key_cache, value_cache, batch, 0.125))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-4, rtol=2e-4)


def test_bad_shapes_get_clear_errors():
    query, key_cache, value_cache, batch = make_batch([(1, 5)], 4, 2, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_triton(query[..., :32].contiguous(), key_cache, value_cache, batch, 1.0)
    with pytest.raises(ValueError, match="do not split"):
        paged_attention_triton(query[:, :3].contiguous(), key_cache, value_cache, batch, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_triton(query.half(), key_cache, value_cache, batch, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, head_dim, block_size", [(2, 64, 8), (1, 80, 16), (4, 128, 32)])
def test_kv_write_matches_reference(dtype, kv_heads, head_dim, block_size):
    generator = torch.Generator().manual_seed(1)
    num_blocks, tokens = 6, 11
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.randn(shape, generator=generator).to(dtype).to(DEVICE) for _ in range(2)]
    expected = [c.clone() for c in caches]
    key = torch.randn((tokens, kv_heads, head_dim), generator=generator).to(dtype).to(DEVICE)
    value = torch.randn((tokens, kv_heads, head_dim), generator=generator).to(dtype).to(DEVICE)
    slots = random.Random(2).sample(range(num_blocks * block_size), tokens)
    slots[3] = -1  # padding: skipped
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    write_kv_triton(key, value, caches[0], caches[1], slot_mapping)
    write_kv_reference(key, value, expected[0], expected[1], slot_mapping)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_block_copy_copies_every_pair_in_every_layer():
    generator = torch.Generator().manual_seed(4)
    cache = torch.randn((3, 2, 8, 4, 2, 64), generator=generator).to(DEVICE)
    expected = cache.clone()
    pairs = torch.tensor([[1, 5], [2, 6], [1, 7]], dtype=torch.int64, device=DEVICE)
    copy_blocks_triton(cache, pairs)
    copy_blocks_reference(expected, pairs)
    assert torch.equal(cache, expected)
    assert torch.equal(cache[:, :, 7], cache[:, :, 1])


@pytest.mark.skipif(not CUDA, reason="needs a GPU with room for an int32-overflowing pool")
def test_offsets_past_int32_do_not_overflow():
    # 2^31 elements of float16 keys: block ids near the end overflow a 32-bit offset.
    block_size, kv_heads, head_dim = 16, 8, 128
    num_blocks = (2**31) // (block_size * kv_heads * head_dim) + 64
    key_cache = torch.zeros((num_blocks, block_size, kv_heads, head_dim), dtype=torch.float16, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    last = [num_blocks - 1, num_blocks - 2]
    key_cache[last] = torch.randn_like(key_cache[last])
    value_cache[last] = torch.randn_like(value_cache[last])
    query = torch.randn((1, 8, head_dim), dtype=torch.float16, device=DEVICE)
    batch = PagedBatch.build([last[1] * block_size + 15], [last], [0, 1], [32], DEVICE)
    out = paged_attention_triton(query, key_cache, value_cache, batch, head_dim**-0.5)
    expected = reference_in_float32(query, key_cache, value_cache, batch, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_residual_rms_norm_is_the_add_then_hf_rms_norm(dtype, with_residual):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 40, generator=generator).to(dtype).to(DEVICE)  # a width that is no power of two
    residual = torch.randn(5, 40, generator=generator).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + torch.randn(40, generator=generator) / 4).to(dtype).to(DEVICE)
    expected_sum = residual + x if with_residual else x
    summed = expected_sum.float()  # HF: the sum in the model's dtype, normalized in float32
    expected = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out = rms_norm_triton(x, weight, 1e-6, residual)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    if with_residual and (CUDA or dtype != torch.bfloat16):
        assert torch.equal(residual, expected_sum)  # updated in place, exactly
    elif with_residual:  # triton's interpreter truncates to bfloat16 where compiled triton rounds
        torch.testing.assert_close(residual, expected_sum, atol=0, rtol=2**-7)


LORA_GROUP = {"q_proj": (40, 24), "k_proj": (40, 8), "v_proj": (40, 8)}  # (in, out); widths not powers of two


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lora_rows_read_each_adapter_through_its_scattered_pages(dtype):
    """Three adapters (ranks 4, 8 and 2, changing all three projections, two, one), their pages scattered over
    the pool and their A matrices in both regions; each row gets its adapter's B @ A @ x in its projections'
    columns, the other rows nothing."""
    generator = torch.Generator().manual_seed(4)
    layers, blocks, half, layer = 2, 40, 48, 1
    pool = torch.zeros((layers, 2, blocks, half), dtype=dtype)
    free = torch.randperm(blocks, generator=generator).tolist()
    adapters = [(4, ("q_proj", "k_proj", "v_proj")), (8, ("q_proj", "v_proj")), (2, ("k_proj",))]
    columns = {"q_proj": 0, "k_proj": 24, "v_proj": 32}
    table = torch.zeros((len(adapters), FIELDS), dtype=torch.int64)
    page_table = torch.zeros((len(adapters), 2 * blocks), dtype=torch.int64)
    matrices = []
    for index, (rank, targets) in enumerate(adapters):
        count, parts = page_layout(rank, targets, LORA_GROUP, half)
        pages = [free.pop() for _ in range(count)]
        page_table[index, : 2 * count] = torch.tensor(pages + [blocks + p for p in pages])
        logical = {key: part.region * count * half + part.offset for key, part in parts.items()}
        values = {key: torch.randn(part.rows * part.cols, generator=generator).to(dtype) for key, part in parts.items()}
        for key, flat in values.items():  # written value by value through the page table, as the kernel reads
            at = logical[key] + torch.arange(flat.numel())
            pool[layer].view(2 * blocks, half)[page_table[index, at // half], at % half] = flat
        row = [rank, len(targets)]
        for projection in targets:
            row += [logical[projection, "A"], logical[projection, "B"], columns[projection], LORA_GROUP[projection][1]]
        table[index, : len(row)] = torch.tensor(row)
        matrices.append(
            {p: (values[p, "A"].view(rank, 40).float(), values[p, "B"].view(rank, -1).float()) for p in targets}
        )
    units = torch.tensor([(0, 1), (2, 0), (3, 2), (5, 1), (6, 0)])  # row 1 and row 4: the base model
    x = torch.randn(7, 40, generator=generator).to(dtype)
    out = torch.randn(7, 40, generator=generator).to(dtype)
    expected = out.float().clone()
    for row, index in units.tolist():
        for projection, (a, b) in matrices[index].items():
            first = columns[projection]
            expected[row, first : first + b.shape[1]] += (x[row].float() @ a.t()) @ b
    out, x = out.to(DEVICE), x.to(DEVICE)
    lora_add_triton(
        x,
        out,
        units.to(DEVICE),
        table.to(DEVICE),
        page_table.to(DEVICE),
        pool.view(-1).to(DEVICE),
        layer * 2 * blocks * half,
        half,
        max_rank=8,
        max_width=24,
    )
    torch.testing.assert_close(out.float().cpu(), expected, atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])
    assert torch.equal(out[[1, 4]].cpu(), expected[[1, 4]].to(dtype))  # rows under no adapter are untouched


CODE_CASES = [  # (rows, outputs, inputs, group, kind, dtype, splits: None for the device's own plan)
    (3, 70, 64, 32, "uint4", torch.float32, None),
    (17, 64, 128, 64, "uint8", torch.float32, None),
    (5, 40, 96, 96, "fp8", torch.float32, 3),
    (2, 64, 256, 64, "uint4", torch.float32, 4),
    (33, 128, 256, 128, "uint4", torch.float16, 2),
] + (
    [
        (64, 4096, 4096, 128, "uint4", torch.float16, None),
        (1, 4096, 4096, 128, "uint4", torch.bfloat16, None),
        (128, 2048, 4096, 128, "fp8", torch.bfloat16, None),
        (16, 14336, 4096, 128, "uint4", torch.float32, None),
    ]
    if CUDA
    else []
)


@pytest.mark.parametrize("rows, outputs, inputs, group, kind, dtype, splits", CODE_CASES)
def test_codes_gemm_matches_the_dequantized_weight(rows, outputs, inputs, group, kind, dtype, splits):
    """Float32 rows are multiplied in float32 (a GPU's TF32 would miss this bound), half rows within their own;
    a product whose inputs are split among programs adds their sums, the bias once; codes spread from words read
    once are the codes read a word a code."""
    from kernels.cpu_linear import dequantize_codes
    from kernels.quant_triton import codes_gemm_triton, pack_codes_gpu

    generator = torch.Generator().manual_seed(rows)
    if kind == "fp8":
        codes = (torch.randn(outputs, inputs, generator=generator) * 3).to(torch.float8_e4m3fn).view(torch.uint8)
        offsets = torch.zeros(outputs, inputs // group)
    else:
        top = 16 if kind == "uint4" else 256
        codes = torch.randint(0, top, (outputs, inputs), dtype=torch.uint8, generator=generator)
        offsets = -torch.randint(0, top, (outputs, inputs // group), generator=generator).float()
    scales = torch.rand(outputs, inputs // group, generator=generator) * 0.02 + 0.001
    offsets = offsets * scales
    x = torch.randn(rows, inputs, generator=generator)
    bias = torch.randn(outputs, generator=generator)
    packed = pack_codes_gpu(codes.to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE), kind)
    got = codes_gemm_triton(x.to(dtype).to(DEVICE), *packed, kind, bias.to(DEVICE), splits=splits)
    word_per_code = codes_gemm_triton(x.to(dtype).to(DEVICE), *packed, kind, bias.to(DEVICE), splits, False)
    assert torch.equal(got, word_per_code)  # each word read once or once a code: the same codes, the same sums
    weight = dequantize_codes(codes, scales, offsets, kind)
    expected = x.to(dtype).float() @ weight.T + bias
    scale = (x.abs() @ weight.abs().T).max().item()
    assert (got.float().cpu() - expected).abs().max().item() <= TOLERANCE[dtype] * scale


def test_a_prompts_rows_in_tiles_of_128_give_the_products_of_the_dequantized_weight():
    """The tall tiles a half-precision prompt takes on a GPU, forced here whatever the rows' dtype: rows past the
    last full tile and outputs past the last full column masked, every product the dequantized weight's."""
    from kernels.cpu_linear import dequantize_codes
    from kernels.quant_triton import codes_gemm_triton, pack_codes_gpu, plan_tiles

    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (72, 128), dtype=torch.uint8, generator=generator)
    scales = torch.rand(72, 2, generator=generator) * 0.02 + 0.001
    offsets = -8 * scales
    x, bias = torch.randn(130, 128, generator=generator), torch.randn(72, generator=generator)
    plan = plan_tiles(130, 72, 128, multiprocessors=132, block_k=64, unpacks=True)
    assert (plan.block_m, plan.block_n) == (128, 64)
    packed = pack_codes_gpu(codes.to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE), "uint4")
    got = codes_gemm_triton(x.to(DEVICE), *packed, "uint4", bias.to(DEVICE), plan=plan)
    weight = dequantize_codes(codes, scales, offsets, "uint4")
    expected = x @ weight.T + bias
    scale = (x.abs() @ weight.abs().T).max().item()
    assert (got.cpu() - expected).abs().max().item() <= TOLERANCE[torch.float32] * scale


def test_a_decode_steps_few_rows_split_their_inputs_to_fill_the_multiprocessors():
    from kernels.quant_triton import plan_tiles

    one_row = plan_tiles(1, 4096, 4096, multiprocessors=132, block_k=64)
    assert one_row.splits > 1 and one_row.splits * one_row.steps_per_split * 64 >= 4096
    assert -(-4096 // 64) * one_row.splits >= 2 * 132  # tiles x splits: two a multiprocessor
    prompt = plan_tiles(2048, 4096, 4096, multiprocessors=132, block_k=64)
    assert prompt.splits == 1 and prompt.block_m > one_row.block_m
    unpacked = plan_tiles(2048, 4096, 4096, multiprocessors=132, block_k=64, unpacks=True)
    assert unpacked.block_m == 2 * prompt.block_m  # each weight tile unpacked serves twice the rows


@pytest.mark.parametrize("static_scale", [0.0, 0.05])
def test_int8_products_on_a_gpu_equal_the_cpu_kernels_numbers(static_scale):
    """The Triton kernel's int32 sums, split or not, and torch's integer product (zero rows padded): the numbers
    of `int8_linear_reference`, to the bit."""
    from kernels.cpu_int8_linear import int8_linear_reference
    from kernels.quant_triton import int8_linear_gpu

    generator = torch.Generator().manual_seed(0)
    for rows in (1, 16, 40):
        x = torch.randn(rows, 96, generator=generator)
        weight = torch.randint(-128, 128, (64, 96), dtype=torch.int8, generator=generator)
        w_scales, bias = torch.rand(64, generator=generator), torch.randn(64, generator=generator)
        expected = int8_linear_reference(x, weight, w_scales, bias, static_scale)
        on_device = (x.to(DEVICE), weight.to(DEVICE), w_scales.to(DEVICE), bias.to(DEVICE))
        for splits in (None, 2):
            assert torch.equal(int8_linear_gpu(*on_device, static_scale, splits=splits).cpu(), expected)
        assert torch.equal(int8_linear_gpu(*on_device, static_scale, sums_by="int_mm").cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rows_quantized_on_a_gpu_take_the_cpu_kernels_codes_and_scales(dtype):
    """One program a row, wider than one block: the reference's codes (ties rounded to even) and scales, to the bit,
    a row of zeros and a static scale included."""
    from kernels.cpu_int8_linear import quantize_rows_reference
    from kernels.quant_triton import quantize_rows_gpu

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 1500, generator=generator).to(dtype)
    x[1] = 0
    x[2, :6] = torch.tensor([127.5, 0.5, 1.5, 2.5, -0.5, -3.5])  # inverse 1: each of these lies halfway
    x[2, 6:] = x[2, 6:].clamp(-1, 1)
    for static_scale in (0.0, 0.05):
        codes, scales = quantize_rows_gpu(x.to(DEVICE), static_scale)
        transposed_twice = quantize_rows_gpu(x.T.contiguous().T.to(DEVICE), static_scale)  # inputs a row apart
        assert all(torch.equal(a, b) for a, b in zip((codes, scales), transposed_twice))
        expected_codes, expected_scales = quantize_rows_reference(x, static_scale)
        assert torch.equal(codes.cpu(), expected_codes) and torch.equal(scales.cpu(), expected_scales)
        if static_scale == 0:
            assert codes[2, :6].tolist() == [127, 0, 2, 2, 0, -4] and codes[1].eq(0).all()


@pytest.mark.parametrize("rows", [1, 16, 256])
def test_the_quantized_kernels_compile_for_a_hopper_gpu_as_planned(rows):
    """Without a GPU: Triton compiles each planned tile for sm_90 (what an H100 or H200 runs) with nothing spilled
    to local memory, and the int8 sums run on the int8 tensor cores (mma on s8), not widened to floats. In a
    process of its own: the interpreter this one runs under replaces what the compiler needs."""
    import json
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.compile_for_gpu", str(rows)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout)
    assert compiled["stacks"] == dict.fromkeys(compiled["stacks"], 0)  # nothing spilled to local memory
    assert len(compiled["stacks"]) == 5 and compiled["int8_tensor_cores"] and compiled["quantize_rounds_each_step"]


def test_e4m3_rows_decoded_by_instructions_or_by_integer_moves_attend_the_same(monkeypatch):
    """A GPU from sm_89 on converts E4M3 bytes itself; older ones decode them with integer moves: the same numbers."""
    from kernels import kv_quant, paged_attention

    query, key_cache, value_cache, batch = make_batch([(3, 20), (1, 9)], 4, 2, 64, 4, torch.float32, seed=3)
    key_rows, value_rows = (kv_quant.quantize(cache, torch.uint8) for cache in (key_cache, value_cache))
    outs = []
    for by_hardware in (True, False):
        monkeypatch.setattr(paged_attention, "fp8_by_hardware", lambda device, by=by_hardware: by)
        outs.append(paged_attention_triton(query, key_rows, value_rows, batch, 0.125))
    assert torch.equal(outs[0], outs[1])
