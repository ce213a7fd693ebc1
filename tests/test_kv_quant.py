"""The quantized KV caches (`--kv-cache-dtype int8|fp8`): rows quantized with their own scale,
attention over them equal to attention over the dequantized values, blocks that move intact under
preemption, and how often greedy tokens agree with a float32 cache's (reported, with a floor)."""

import random
import re

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from kernels import cpu_attention, dispatch, kv_quant
from kernels.batch import PagedBatch
from kernels.paged_attention import paged_attention_reference
from services.launcher import SHIPPED_MODEL
from services.worker.kv_cache import bytes_per_block
from tests.conftest import serve
from tests.engine_harness import Engine

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

TEXTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "# read a file\nwith open(path) as f:",
    "def quicksort(xs):",
    "import json\n\ndef load(path):",
    "while True:",
]


def test_a_row_comes_back_within_half_a_quantization_step():
    rows = torch.randn(7, 4, 64) * torch.rand(7, 4, 1) * 10
    back = kv_quant.dequantize(kv_quant.quantize(rows), torch.float32)
    step = rows.abs().amax(-1, keepdim=True) / kv_quant.QMAX
    assert ((back - rows).abs() <= step / 2 + 1e-6).all()
    assert kv_quant.dequantize(kv_quant.quantize(torch.zeros(2, 64)), torch.float32).eq(0).all()


def test_an_fp8_row_keeps_each_value_within_half_a_step_of_e4m3():
    rows = torch.randn(7, 4, 64) * torch.rand(7, 4, 1) * 10
    stored = kv_quant.quantize(rows, torch.uint8)
    back = kv_quant.dequantize(stored, torch.float32)
    scale = rows.abs().amax(-1, keepdim=True) / kv_quant.FP8_MAX
    # 3 mantissa bits: half a step is 1/16 of the value; below 2^-6 the steps are 2^-9 (subnormals)
    assert ((back - rows).abs() <= rows.abs() / 16 + scale * 2**-10 + 1e-7).all()
    assert back.abs().amax(-1).sub(rows.abs().amax(-1)).abs().max() < 1e-5  # the largest is exact: 448
    assert stored[..., : -kv_quant.SCALE_BYTES].ne(0x7F).all() and stored[..., : -kv_quant.SCALE_BYTES].ne(0xFF).all()


def test_an_int8_block_holds_its_rows_in_a_quarter_of_the_bytes_and_its_scales_beside_them():
    assert bytes_per_block(6, 16, 2, 64, torch.float32) / bytes_per_block(
        6, 16, 2, 64, torch.float32, "int8"
    ) == pytest.approx(256 / 68)
    assert bytes_per_block(6, 16, 2, 64, torch.float16) / bytes_per_block(
        6, 16, 2, 64, torch.float16, "int8"
    ) == pytest.approx(128 / 68)


@pytest.mark.parametrize("storage", [torch.int8, torch.uint8], ids=["int8", "fp8"])
@pytest.mark.parametrize("mode", ["auto", "torch", "reference", "triton"])
def test_attention_over_a_quantized_cache_is_attention_over_its_dequantized_values(
    mode, storage, monkeypatch, kernels_chosen
):
    kernels_chosen(backend=mode)
    generator = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, head_dim, num_blocks = 4, 2, 4, 64, 24
    lengths, queries = [9, 1, 14], [1, 1, 5]  # two decoding sequences and a chunk of a prompt
    blocks = random.Random(0).sample(range(num_blocks), sum(-(-n // block_size) for n in lengths))
    tables, slots, at = [], [], 0
    for length, new in zip(lengths, queries):
        table = blocks[at : at + -(-length // block_size)]
        at += len(table)
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(length - new, length)]
    starts = [0]
    for new in queries:
        starts.append(starts[-1] + new)
    batch = PagedBatch.build(slots, tables, starts, lengths, torch.device("cpu"))
    width = head_dim + kv_quant.SCALE_BYTES
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, width, dtype=storage)
    value_cache = torch.zeros_like(key_cache)
    float_keys = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    float_values = torch.zeros_like(float_keys)
    for table, length in zip(tables, lengths):  # every earlier position of each sequence, quantized
        for p in range(length):
            block, offset = table[p // block_size], p % block_size
            k, v = torch.randn(2, kv_heads, head_dim, generator=generator)
            key_cache[block, offset] = kv_quant.quantize(k, storage)
            value_cache[block, offset] = kv_quant.quantize(v, storage)
            float_keys[block, offset], float_values[block, offset] = k, v
    new_keys = torch.randn(len(slots), kv_heads, head_dim, generator=generator)
    new_values = torch.randn(len(slots), kv_heads, head_dim, generator=generator)
    dispatch.write_kv(new_keys, new_values, key_cache, value_cache, batch.slot_mapping)
    dispatch.write_kv(new_keys, new_values, float_keys, float_values, batch.slot_mapping)
    query = torch.randn(len(slots), heads, head_dim, generator=generator)

    reads_bytes = mode == "triton" or (mode == "auto" and cpu_attention.native_kernel() is not None)
    if mode == "auto" and reads_bytes:
        assert cpu_attention.native_accepts(query, key_cache, value_cache)  # the C kernel reads the bytes itself
    if reads_bytes:  # as Triton does (interpreted here): nothing is dequantized first
        monkeypatch.setattr(kv_quant, "compact", lambda *args: pytest.fail("dequantized before attention"))
    got = dispatch.paged_attention(query, key_cache, value_cache, batch, head_dim**-0.5)
    dequantized = paged_attention_reference(
        query,
        kv_quant.dequantize(key_cache, torch.float32),
        kv_quant.dequantize(value_cache, torch.float32),
        batch,
        head_dim**-0.5,
    )
    unquantized = paged_attention_reference(query, float_keys, float_values, batch, head_dim**-0.5)
    torch.testing.assert_close(got, dequantized, atol=1e-5, rtol=1e-5)
    assert (got - unquantized).abs().max() < (0.05 if storage == torch.int8 else 0.15)  # the quantization's own error


@pytest.fixture(scope="module")
def shipped_prompts() -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_blocks_move_intact_under_swapping_and_recomputation(kv_cache_dtype, shipped_prompts):
    roomy = Engine(SHIPPED_MODEL, kv_cache_dtype=kv_cache_dtype).generate(shipped_prompts, max_tokens=40)
    for mode in ("swap", "recompute"):
        tight = Engine(SHIPPED_MODEL, block_size=4, num_gpu_blocks=40, preemption=mode, kv_cache_dtype=kv_cache_dtype)
        assert tight.generate(shipped_prompts, max_tokens=40) == roomy
        assert tight.stats().num_preemptions_swap + tight.stats().num_preemptions_recompute > 0


@pytest.mark.parametrize("kv_cache_dtype, floor", [("int8", (0.6, 4)), ("fp8", (0.5, 2))])
def test_greedy_tokens_mostly_agree_with_a_float32_cache_over_64_tokens(kv_cache_dtype, floor, shipped_prompts):
    exact = Engine(SHIPPED_MODEL).generate(shipped_prompts, max_tokens=64)
    quantized = Engine(SHIPPED_MODEL, kv_cache_dtype=kv_cache_dtype).generate(shipped_prompts, max_tokens=64)
    positions = sum(len(a) for a in exact)
    match = sum(x == y for a, b in zip(exact, quantized) for x, y in zip(a, b)) / positions
    identical = sum(a == b for a, b in zip(exact, quantized))
    print(
        f"{kv_cache_dtype} KV cache, shipped model, 8 prompts x 64 greedy tokens: {match:.3f} of positions agree, "
        f"{identical} of 8 sequences identical"
    )
    # measured on 2026-11-25: int8 0.775 and 6 of 8; fp8 0.699 and 3 of 8 (3 mantissa bits to int8's 7)
    assert match >= floor[0] and identical >= floor[1]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_server_holds_3_8_times_the_blocks_in_the_same_memory_and_serves_the_same_tokens(
    kv_cache_dtype, shipped_prompts, tmp_path
):
    with serve(None, str(tmp_path), "--kv-cache-dtype", kv_cache_dtype, "--kv-cache-memory", "0.05") as server:
        body = {
            "model": server.model,
            "prompt": shipped_prompts[0],
            "max_tokens": 24,
            "temperature": 0,
            "return_token_ids": True,
        }
        answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
        [blocks] = re.findall(rf"KV cache: (\d+) blocks of 16 tokens \([0-9.]+ MiB, {kv_cache_dtype}\)", server.log())
    float_blocks = int(0.05 * 2**30 // bytes_per_block(6, 16, 2, 64, torch.float32))
    assert int(blocks) == int(0.05 * 2**30 // bytes_per_block(6, 16, 2, 64, torch.float32, kv_cache_dtype))
    assert int(blocks) / float_blocks == pytest.approx(256 / 68, rel=0.01)
    expected = Engine(SHIPPED_MODEL, kv_cache_dtype=kv_cache_dtype).generate(shipped_prompts[:1], max_tokens=24)[0]
    assert answer["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize("storage", [torch.int8, torch.uint8], ids=["int8", "fp8"])
def test_the_fused_rotary_write_stores_what_torch_would_within_a_quantization_step(storage):
    from kernels.kv_write import write_kv_reference
    from kernels.rotary import QUANTIZED_SYMBOLS, apply_rope, native_kernel, rotate_and_write_native

    if native_kernel(QUANTIZED_SYMBOLS[storage]) is None:
        pytest.skip("no C compiler here")
    generator = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 64
    query, key, value = (torch.randn(tokens, n, head_dim, generator=generator) for n in (heads, kv_heads, kv_heads))
    angles = torch.arange(tokens)[:, None] / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    slots = torch.tensor([0, 1, 2, 5, -1])
    fused = [torch.zeros(3, 4, kv_heads, head_dim + kv_quant.SCALE_BYTES, dtype=storage) for _ in range(2)]
    reference = [torch.zeros_like(fused[0]) for _ in range(2)]
    rotated = query.clone()
    assert rotate_and_write_native(rotated, key, value, cos, sin, *fused, slots)
    write_kv_reference(
        kv_quant.quantize(apply_rope(key, cos, sin), storage), kv_quant.quantize(value, storage), *reference, slots
    )
    torch.testing.assert_close(rotated, apply_rope(query, cos, sin))
    for mine, theirs in zip(fused, reference):
        expected = kv_quant.dequantize(theirs, torch.float32)
        if storage == torch.int8:
            step = expected.abs().amax(-1, keepdim=True) / kv_quant.QMAX
        else:  # one E4M3 step at most: an eighth of the value, or 2^-9 of the scale among the subnormals
            step = expected.abs() / 8 + expected.abs().amax(-1, keepdim=True) / kv_quant.FP8_MAX * 2**-9
        difference = (kv_quant.dequantize(mine, torch.float32) - expected).abs()
        assert (difference <= step * 1.01 + 1e-7).all()
        assert mine[0, 3].eq(0).all() and mine[1, 2:].eq(0).all()  # untouched slots stay empty
        written = theirs[..., : -kv_quant.SCALE_BYTES].ne(0).any(-1)
        same = mine[..., : -kv_quant.SCALE_BYTES].eq(theirs[..., : -kv_quant.SCALE_BYTES])[written]
        assert same.float().mean() > 0.99  # rounded as torch rounds: the bytes themselves agree
