"""The disk tier (--kv-cache-dir): every cached full block is written to a file named by its key, a
later start finds the files (a warm restart), and a file that is not whole and right is never
served: its block is computed again."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch

from services.worker.disk_tier import DiskTier
from shared.prefix_keys import ROOT, chain_key
from tests.conftest import serve
from tests.engine_harness import Engine
from tests.tiny_models import hf_greedy

BLOCK = 4
PROMPTS = [[11 + 2 * i + j for j in range(26)] for i in range(3)]  # six full blocks each
MAX_TOKENS = 4


def engine(llama_dir: str, folder: str) -> Engine:
    return Engine(llama_dir, block_size=BLOCK, num_gpu_blocks=48, prefix_caching=True, num_host_cache_blocks=32,
                  kv_cache_dir=folder)


def files(folder: str) -> list[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
                  if name.endswith(".kv"))


def test_a_new_engine_starts_on_the_blocks_an_earlier_one_wrote_and_gives_hf_tokens(llama_dir, tmp_path):
    expected = [hf_greedy(llama_dir, p, MAX_TOKENS) for p in PROMPTS]
    first = engine(llama_dir, str(tmp_path))
    assert first.generate(PROMPTS, max_tokens=MAX_TOKENS) == expected
    first.cache.disk.close()
    written = first.stats().blocks_written_to_disk
    assert written >= 3 * 6 and len(files(str(tmp_path))) == written

    restarted = engine(llama_dir, str(tmp_path))
    assert restarted.stats().num_disk_blocks == written
    assert restarted.generate(PROMPTS, max_tokens=MAX_TOKENS) == expected
    stats = restarted.stats()
    assert stats.blocks_read_from_disk >= 3 * 6 and stats.disk_reads_refused == 0
    assert stats.num_prompt_tokens_computed <= 3 * (26 - 6 * BLOCK + BLOCK)  # at most the last block of each again


def test_a_corrupted_truncated_or_foreign_file_is_computed_again_and_written_anew(llama_dir, tmp_path):
    expected = [hf_greedy(llama_dir, p, MAX_TOKENS) for p in PROMPTS]
    first = engine(llama_dir, str(tmp_path))
    first.generate(PROMPTS, max_tokens=MAX_TOKENS)
    first.cache.disk.close()
    folder = first.cache.disk.folder
    flipped, truncated, foreign = (os.path.join(folder, first_key(p).hex() + ".kv") for p in PROMPTS)
    data = bytearray(Path(flipped).read_bytes())
    data[len(data) // 2] ^= 0x40
    Path(flipped).write_bytes(bytes(data))
    os.truncate(truncated, os.path.getsize(truncated) // 2)
    second_block = os.path.join(folder, chain_key(first_key(PROMPTS[0]), PROMPTS[0][BLOCK:2 * BLOCK]).hex() + ".kv")
    Path(foreign).write_bytes(Path(second_block).read_bytes())  # whole, but another key's block

    restarted = engine(llama_dir, str(tmp_path))
    assert restarted.generate(PROMPTS, max_tokens=MAX_TOKENS) == expected
    assert restarted.stats().disk_reads_refused == 3
    restarted.cache.disk.close()
    # Their blocks were computed again and written anew: a third start reads every one.
    again = engine(llama_dir, str(tmp_path))
    assert again.generate(PROMPTS, max_tokens=MAX_TOKENS) == expected
    assert again.stats().disk_reads_refused == 0 and again.stats().blocks_read_from_disk >= 3 * 6


def first_key(prompt: list[int]) -> bytes:
    return chain_key(ROOT, prompt[:BLOCK])


def test_the_disk_never_serves_one_cache_salt_the_blocks_of_another(llama_dir, tmp_path):
    first = engine(llama_dir, str(tmp_path))
    ids = [first.add(p, cache_salt="tenant a", max_tokens=MAX_TOKENS) for p in PROMPTS]
    first.run()
    first.cache.disk.close()
    restarted = engine(llama_dir, str(tmp_path))
    ids = [restarted.add(p, cache_salt="tenant b", max_tokens=MAX_TOKENS) for p in PROMPTS]
    tokens = restarted.run()
    assert [tokens[i][0] for i in ids] == [hf_greedy(llama_dir, p, MAX_TOKENS) for p in PROMPTS]
    assert restarted.stats().blocks_read_from_disk == 0
    restarted.generate(PROMPTS[:1], cache_salt="tenant a", max_tokens=MAX_TOKENS)
    assert restarted.stats().blocks_read_from_disk > 0


def test_a_block_file_reads_back_only_whole_and_for_its_own_key_and_fingerprint(tmp_path):
    tier = DiskTier(str(tmp_path), "print", 0, 1)
    block = torch.randn(2, 2, 4, 2, 8)
    key, other_key = bytes(range(32)), bytes(range(1, 33))
    tier.write_many([key], block.unsqueeze(2))
    tier.flush()
    into = torch.empty_like(block)
    assert tier.read(key, into) and torch.equal(into, block)
    assert not tier.read(other_key, into)  # no file
    path = os.path.join(tier.folder, key.hex() + ".kv")
    os.rename(path, os.path.join(tier.folder, other_key.hex() + ".kv"))
    assert not tier.read(other_key, into)  # a file of another key under its name
    os.rename(os.path.join(tier.folder, other_key.hex() + ".kv"), path)
    assert not DiskTier(str(tmp_path), "another print", 0, 1).read(key, into)  # another model's folder
    assert not tier.read(key, torch.empty(2, 2, 4, 2, 4))  # another layout
    whole = Path(path).read_bytes()
    for broken in (whole[:-1], whole[:40], whole[:-40] + bytes(40)):
        Path(path).write_bytes(broken)
        assert not tier.read(key, into)
    for leftover in os.listdir(tier.folder):  # a write interrupted before its rename leaves no block file
        assert not leftover.endswith(".tmp")


@pytest.mark.slow
def test_a_restarted_server_serves_a_long_prompt_from_its_disk_cache(llama_dir, tmp_path):
    prompt = [5 + (i * 7) % 200 for i in range(240)]
    flags = ["--block-size", "16", "--enable-prefix-caching", "--kv-cache-dir", str(tmp_path / "kv")]

    def complete(server) -> dict:
        body = {"model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        return response.json()

    with serve(llama_dir, str(tmp_path), *flags) as server:
        cold = complete(server)
        assert server.metrics("scheduler")['pagedserve_blocks_on_disk_total{direction="written"}'] >= 240 // 16
    with serve(llama_dir, str(tmp_path), *flags) as server:
        warm = complete(server)
        assert server.metrics("scheduler")['pagedserve_blocks_on_disk_total{direction="read"}'] >= 240 // 16 - 1
        assert "found under" in server.log()
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"] == hf_greedy(llama_dir, prompt, 4)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * len(prompt)
