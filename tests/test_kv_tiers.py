"""The host cache (--kv-offloading-size): prefix blocks the device evicts are written back to host
memory with their keys, and a later prompt that matches them loads them instead of computing them.

Each test drives the real scheduler and model runner (tests/engine_harness.py, which audits every
tier's block accounting after each step) with a device pool too small for the working set.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from shared.config import SpeculativeConfig
from tests.conftest import serve
from tests.engine_harness import Engine
from tests.tiny_models import hf_greedy

BLOCK = 4
DEVICE_BLOCKS = 24  # 96 tokens: three requests of the rounds below at most
FIRST = [[7 + 3 * i + j for j in range(20)] for i in range(3)]  # five full blocks each
OTHERS = [[90 + 5 * i + j for j in range(20)] for i in range(3)]
MAX_TOKENS = 4


def rounds(engine: Engine, salt_again: str = "") -> list[list[int]]:
    """FIRST one at a time, then OTHERS (which evict FIRST's blocks from the device), then FIRST again."""
    outputs = [engine.generate([p], max_tokens=MAX_TOKENS) for p in FIRST + OTHERS]
    again = [engine.add(p, cache_salt=salt_again, max_tokens=MAX_TOKENS) for p in FIRST]
    tokens = engine.run()
    return [o[0] for o in outputs] + [tokens[i][0] for i in again]


@pytest.mark.parametrize("write_through", [False, True], ids=["write-back", "write-through"])
@pytest.mark.parametrize("depth", [1, 2], ids=["planned-after", "planned-ahead"])
def test_greedy_output_equals_hf_with_the_host_cache_under_forced_eviction(llama_dir, depth, write_through):
    expected = [hf_greedy(llama_dir, p, MAX_TOKENS) for p in FIRST + OTHERS + FIRST]
    tiered = Engine(
        llama_dir,
        block_size=BLOCK,
        num_gpu_blocks=DEVICE_BLOCKS,
        prefix_caching=True,
        num_host_cache_blocks=64,
        depth=depth,
        write_through=write_through,
    )
    plain = Engine(llama_dir, block_size=BLOCK, num_gpu_blocks=DEVICE_BLOCKS, prefix_caching=True, depth=depth)
    assert rounds(tiered) == expected
    assert rounds(plain) == expected
    with_tier, without = tiered.stats(), plain.stats()
    assert with_tier.blocks_offloaded > 0 and with_tier.blocks_loaded > 0
    assert with_tier.prefix_hits_host_tokens == with_tier.blocks_loaded * BLOCK
    assert without.blocks_offloaded == without.blocks_loaded == without.prefix_hits_host_tokens == 0
    # FIRST's second round was evicted from the device: without the host cache it is computed again.
    assert with_tier.num_prompt_tokens_computed < without.num_prompt_tokens_computed


@pytest.mark.parametrize("write_through", [False, True], ids=["write-back", "write-through"])
def test_a_block_loaded_from_the_host_cache_holds_exactly_what_was_computed(llama_dir, write_through):
    engine = Engine(
        llama_dir,
        block_size=BLOCK,
        num_gpu_blocks=DEVICE_BLOCKS,
        prefix_caching=True,
        num_host_cache_blocks=64,
        write_through=write_through,
    )
    device = engine.scheduler.kv_cache.device_pool
    computed: dict[bytes, torch.Tensor] = {}

    def remember(engine):
        for key, block in device._by_hash.items():
            computed.setdefault(key, engine.cache.cache[:, :, block].clone())

    for prompt in FIRST:
        engine.add(prompt, max_tokens=MAX_TOKENS)
        engine.run(on_step=remember)
    first_keys = set(device._by_hash)
    for prompt in OTHERS:
        engine.generate([prompt], max_tokens=MAX_TOKENS)
    evicted = first_keys - set(device._by_hash)
    assert evicted and all(engine.scheduler.kv_cache.host_cache.holds(key) for key in evicted)
    loaded_before = engine.stats().blocks_loaded
    engine.generate(FIRST, max_tokens=MAX_TOKENS)
    assert engine.stats().blocks_loaded > loaded_before
    back = [key for key in evicted if key in device._by_hash]
    assert back
    for key in back:
        assert torch.equal(engine.cache.cache[:, :, device._by_hash[key]], computed[key])


def test_the_host_cache_never_serves_one_cache_salt_the_blocks_of_another(llama_dir):
    engine = Engine(
        llama_dir, block_size=BLOCK, num_gpu_blocks=DEVICE_BLOCKS, prefix_caching=True, num_host_cache_blocks=64
    )
    expected = [hf_greedy(llama_dir, p, MAX_TOKENS) for p in FIRST + OTHERS + FIRST]
    assert rounds(engine, salt_again="another tenant") == expected
    stats = engine.stats()
    assert stats.blocks_offloaded > 0
    assert stats.blocks_loaded == stats.prefix_hits_host_tokens == 0
    # The same prompts under the salt they were computed with are found in the host cache.
    engine.generate(FIRST, max_tokens=MAX_TOKENS)
    assert engine.stats().blocks_loaded > 0


def test_a_full_host_cache_keeps_the_latest_blocks_and_still_gives_hf_tokens(llama_dir):
    engine = Engine(
        llama_dir, block_size=BLOCK, num_gpu_blocks=DEVICE_BLOCKS, prefix_caching=True, num_host_cache_blocks=6
    )
    expected = [hf_greedy(llama_dir, p, MAX_TOKENS) for p in FIRST + OTHERS + FIRST]
    assert rounds(engine) == expected
    host = engine.scheduler.kv_cache.host_cache
    assert host.num_evictable == host.num_blocks == 6
    assert engine.stats().blocks_offloaded > 6  # more went in than it holds: the oldest made room


@pytest.mark.slow
def test_a_server_with_kv_offloading_loads_evicted_prefixes_back_and_counts_them(llama_dir, tmp_path):
    flags = [
        "--block-size",
        str(BLOCK),
        "--num-gpu-blocks-override",
        str(DEVICE_BLOCKS),
        "--enable-prefix-caching",
        "--kv-offloading-size",
        "0.002",
    ]
    with serve(llama_dir, str(tmp_path), *flags) as server:

        def complete(prompt):
            body = {
                "model": server.model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            }
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            response.raise_for_status()
            return response.json()["choices"][0]["token_ids"]

        got = [complete(p) for p in FIRST + OTHERS + FIRST]
        metrics = server.metrics("scheduler")
        assert 'pagedserve_kv_blocks_capacity{device="cpu",pool="host_cache"}' in metrics
        assert metrics['pagedserve_blocks_offloaded_total{direction="out"}'] > 0
        assert metrics['pagedserve_blocks_offloaded_total{direction="in"}'] > 0
        assert metrics['pagedserve_prefix_cache_tier_hits_total{tier="host"}'] > 0
        assert "host cache:" in server.log()
    assert got == [hf_greedy(llama_dir, p, MAX_TOKENS) for p in FIRST + OTHERS + FIRST]


@pytest.mark.parametrize(
    "options",
    [
        {"kv_cache_dtype": "int8"},
        {"dtype": "bfloat16"},
        {"beams": True},
        {"samples": True},
        {"speculative": SpeculativeConfig("ngram", 4, 1, 3), "depth": 2},
    ],
    ids=["int8-cache", "bf16", "beam-search", "n-2", "ngram-speculation-planned-ahead"],
)
def test_the_host_cache_changes_no_token_with_quantized_or_half_caches_beams_samples_or_speculation(llama_dir, options):
    """Loaded blocks are byte copies: whatever the cache holds, the host cache gives the tokens computing gives."""
    options = dict(options)
    sampling = {}
    if options.pop("beams", False):
        sampling = {"use_beam_search": True, "best_of": 2, "n": 2}
    if options.pop("samples", False):
        sampling = {"n": 2, "temperature": 1.0, "seed": 5}

    def rounds_of(engine: Engine) -> list[dict[int, list[int]]]:
        outputs = []
        for prompt in FIRST + OTHERS + FIRST:
            request_id = engine.add(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
            outputs.append(engine.run()[request_id])
        return outputs

    tiered = Engine(
        llama_dir,
        block_size=BLOCK,
        num_gpu_blocks=DEVICE_BLOCKS,
        prefix_caching=True,
        num_host_cache_blocks=64,
        **options,
    )
    plain = Engine(llama_dir, block_size=BLOCK, num_gpu_blocks=DEVICE_BLOCKS, prefix_caching=True, **options)
    assert rounds_of(tiered) == rounds_of(plain)
    assert tiered.stats().blocks_loaded > 0 and plain.stats().blocks_loaded == 0


@pytest.mark.slow
def test_tensor_parallel_ranks_share_the_host_cache_and_the_disk_and_restart_warm(llama_dir, tmp_path):
    flags = [
        "--tensor-parallel-size",
        "2",
        "--block-size",
        str(BLOCK),
        "--num-gpu-blocks-override",
        str(DEVICE_BLOCKS),
        "--enable-prefix-caching",
        "--kv-offloading-size",
        "0.002",
        "--kv-cache-dir",
        str(tmp_path / "kv"),
    ]

    def complete(server, prompt):
        body = {
            "model": server.model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        return response.json()

    with serve(llama_dir, str(tmp_path), *flags) as server:
        got = [complete(server, p)["choices"][0]["token_ids"] for p in FIRST + OTHERS + FIRST]
        metrics = server.metrics("scheduler")
        assert metrics['pagedserve_blocks_offloaded_total{direction="in"}'] > 0
    assert got == [hf_greedy(llama_dir, p, MAX_TOKENS) for p in FIRST + OTHERS + FIRST]
    assert {path.name for path in (tmp_path / "kv").glob("*/*")} == {"rank0", "rank1"}
    with serve(llama_dir, str(tmp_path), *flags) as server:
        warm = complete(server, FIRST[0])
        assert server.metrics("scheduler")['pagedserve_blocks_on_disk_total{direction="read"}'] > 0
    assert warm["choices"][0]["token_ids"] == hf_greedy(llama_dir, FIRST[0], MAX_TOKENS)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK  # all but the last block
