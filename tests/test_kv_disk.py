"""The disk tier (--kv-cache-dir): every cached full block is written to a file named by its key, a
later start finds the files (a warm restart), and a file that is not whole and right is never
served: its block is computed again."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from services.scheduler.disk_index import DiskIndex
from services.worker.disk_tier import DiskTier
from shared.kv_folder import KVFolderError, let_go
from shared.prefix_keys import ROOT, chain_key
from tests.conftest import ROOT as ROOT_DIR
from tests.conftest import serve
from tests.engine_harness import Engine
from tests.tiny_models import hf_greedy

BLOCK = 4
PROMPTS = [[11 + 2 * i + j for j in range(26)] for i in range(3)]  # six full blocks each
MAX_TOKENS = 4


def engine(llama_dir: str, folder: str) -> Engine:
    return Engine(
        llama_dir,
        block_size=BLOCK,
        num_gpu_blocks=48,
        prefix_caching=True,
        num_host_cache_blocks=32,
        kv_cache_dir=folder,
    )


def files(folder: str) -> list[str]:
    return sorted(
        os.path.join(root, name) for root, _, names in os.walk(folder) for name in names if name.endswith(".kv")
    )


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
    second_block = os.path.join(folder, chain_key(first_key(PROMPTS[0]), PROMPTS[0][BLOCK : 2 * BLOCK]).hex() + ".kv")
    Path(foreign).write_bytes(Path(second_block).read_bytes())  # whole, but another key's block

    restarted = engine(llama_dir, str(tmp_path))
    assert restarted.generate(PROMPTS, max_tokens=MAX_TOKENS) == expected
    assert restarted.stats().disk_reads_refused == 3
    restarted.cache.disk.close()
    # Their blocks were computed again and written anew: a third start reads every one.
    again = engine(llama_dir, str(tmp_path))
    assert again.generate(PROMPTS, max_tokens=MAX_TOKENS) == expected
    assert again.stats().disk_reads_refused == 0 and again.stats().blocks_read_from_disk >= 3 * 6


def test_a_held_read_from_disk_holds_no_step_and_its_request_starts_once_the_read_lands(
    llama_dir, tmp_path, monkeypatch
):
    first = engine(llama_dir, str(tmp_path))
    first.generate(PROMPTS[:1], max_tokens=MAX_TOKENS)
    first.cache.disk.close()
    restarted = engine(llama_dir, str(tmp_path))
    running = restarted.add(PROMPTS[1], max_tokens=40)  # nothing of it on disk: it decodes meanwhile
    started, release = threading.Event(), threading.Event()
    read = DiskTier.read

    def held_read(tier, key, into):  # as a slow disk would
        started.set()
        assert release.wait(30)
        return read(tier, key, into)

    monkeypatch.setattr(DiskTier, "read", held_read)
    waiting = restarted.add(PROMPTS[0], max_tokens=MAX_TOKENS)
    steps_while_held = 0

    def on_step(engine):
        nonlocal steps_while_held
        if started.is_set() and not release.is_set():
            steps_while_held += 1
            if steps_while_held == 8:
                release.set()

    tokens = restarted.run(on_step=on_step)
    assert steps_while_held == 8  # a read on the step would have held the first of them
    assert tokens[waiting][0] == hf_greedy(llama_dir, PROMPTS[0], MAX_TOKENS)
    assert tokens[running][0] == hf_greedy(llama_dir, PROMPTS[1], 40)
    assert restarted.stats().blocks_read_from_disk >= 6 and restarted.stats().disk_reads_refused == 0


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


def _written(tmp_path) -> tuple[DiskTier, bytes, torch.Tensor, str]:
    tier = DiskTier(str(tmp_path), "print", 0, 1)
    block, key = torch.randn(2, 2, 4, 2, 8), bytes(range(32))
    tier.write_many([key], block.unsqueeze(2))
    tier.flush()
    return tier, key, block, os.path.join(tier.folder, key.hex() + ".kv")


def test_a_fifo_in_place_of_a_block_file_is_refused_at_once_and_the_worker_goes_on(tmp_path):
    tier, key, block, path = _written(tmp_path)
    os.unlink(path)
    os.mkfifo(path)  # open() on a FIFO with no writer waits for one forever
    reader = threading.Thread(target=lambda: results.append(tier.read(key, torch.empty_like(block))))
    results: list[bool] = []
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and results == [False]


def test_a_huge_sparse_file_or_a_link_in_place_of_a_block_file_is_refused_unread(tmp_path):
    tier, key, block, path = _written(tmp_path)
    whole = Path(path).read_bytes()
    os.unlink(path)
    with open(path, "wb") as f:
        f.truncate(2 << 30)  # 2 GiB of nothing, read whole before
    assert not tier.read(key, torch.empty_like(block))
    os.unlink(path)
    elsewhere = tmp_path / "elsewhere.kv"
    elsewhere.write_bytes(whole)
    os.symlink(elsewhere, path)  # the right bytes, through a link: refused all the same
    assert not tier.read(key, torch.empty_like(block))
    os.unlink(path)
    Path(path).write_bytes(whole)
    assert tier.read(key, into := torch.empty_like(block)) and torch.equal(into, block)


@pytest.mark.parametrize("level", ["folder", "rank folder"])
def test_a_kv_folder_others_may_write_is_refused_at_start_with_the_reason(tmp_path, level):
    folder = tmp_path / "kv"
    made = folder if level == "folder" else folder / "print" / "rank0"
    made.mkdir(parents=True)
    for path in (folder, folder / "print", made):
        if path.exists():
            path.chmod(0o700)
    made.chmod(0o777)
    with pytest.raises(KVFolderError, match="may be written by others"):
        DiskTier(str(folder), "print", 0, 1)
    made.chmod(0o700)
    DiskTier(str(folder), "print", 0, 1)


def test_two_servers_cannot_share_one_kv_folder_and_its_size_bound(tmp_path):
    holding = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from shared.kv_folder import hold; "
            f"hold({str(tmp_path)!r}); print('held', flush=True); sys.stdin.read()",
        ],
        cwd=ROOT_DIR,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holding.stdout.readline() == "held\n"  # another server's scheduler
        with pytest.raises(KVFolderError, match="another server uses"):
            DiskIndex(str(tmp_path), "print", 1, 100)
    finally:
        holding.communicate("")  # it ends: a restart takes the folder again
    DiskIndex(str(tmp_path), "print", 1, 100)
    let_go(str(tmp_path))


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
