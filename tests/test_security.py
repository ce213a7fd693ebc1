"""What a stranger can and cannot do: API keys on the OpenAI routes, no sockets left behind,
prefix-cache keys no prompt can forge."""

import hashlib
import os
import shutil
import subprocess
import sys
from array import array

import httpx
import openai
import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request, Sequence
from shared.sampling import SamplingParams
from tests.conftest import ROOT, free_port, metrics_port_flags, serve
from tests.tiny_models import hf_greedy


def test_an_api_key_guards_the_openai_routes_and_leaves_health_and_metrics_open(llama_dir, tmp_path):
    prompt = [5, 9, 13, 200]
    with serve(llama_dir, str(tmp_path), env={"PAGEDSERVE_API_KEY": "s3cret"}) as server:
        url = f"{server.base_url}/v1"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.get(f"{url}/models", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong").completions.create(model=server.model, prompt=prompt)
        completion = openai.OpenAI(base_url=url, api_key="s3cret").completions.create(
            model=server.model, prompt=prompt, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
        assert completion.choices[0].model_extra["token_ids"] == hf_greedy(llama_dir, prompt, 6)
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        assert httpx.get(f"{server.base_url}/metrics").status_code == 200
        assert "s3cret" not in " ".join(_command_lines(server.process.pid))  # not on any command line


def _command_lines(pid: int) -> list[str]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    lines = []
    for child in [str(pid), *children]:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            lines.append(f.read().replace(b"\0", b" ").decode())
    return lines


def test_the_launcher_removes_its_socket_directory_however_it_exits(llama_dir, tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    with serve(llama_dir, str(tmp_path), env={"TMPDIR": str(temp)}):
        assert [p.name[:11] for p in temp.iterdir()] == ["pagedserve-"]
        assert (next(temp.iterdir()).stat().st_mode & 0o777) == 0o700
    assert list(temp.iterdir()) == []  # after SIGINT

    broken = tmp_path / "broken"  # no weights: the worker dies and the launcher stops the others
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(llama_dir, name), broken)
    cmd = [sys.executable, "-m", "services.launcher", "up", "--model", str(broken), "--port", str(free_port()), *metrics_port_flags(),
           "--device", "cpu", "--ready-timeout", "60"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90,
                          env=dict(os.environ, TMPDIR=str(temp)))
    assert done.returncode != 0 and "worker exited" in done.stderr
    assert list(temp.iterdir()) == []


def _sequence(tokens: list[int]) -> Sequence:
    return Sequence(0, Request("r", tokens, SamplingParams(), 0.0), 0)


def test_prefix_cache_keys_are_a_sha256_chain_over_the_whole_prefix():
    manager = BlockManager(16, 4, enable_prefix_caching=True)
    first = _sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    manager.start(first, [])
    manager.append_slots(first, 9)
    first.num_computed_tokens = 9
    manager.cache_full_blocks(first)
    root = hashlib.sha256(array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert first.block_hashes == [root, hashlib.sha256(root + array("q", [5, 6, 7, 8]).tobytes()).digest()]
    assert manager.match_prefix(_sequence([1, 2, 3, 4, 5, 6, 7, 8, 0])) == first.block_table[:2]
    # The same second block after another first block is another key: no hit.
    assert manager.match_prefix(_sequence([0, 2, 3, 4, 5, 6, 7, 8, 0])) == []
