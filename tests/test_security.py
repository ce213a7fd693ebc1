"""What a stranger can and cannot do: API keys on the OpenAI routes, prefix-cache keys no prompt can
forge. (The launcher's private socket directory and its removal: tests/test_stopping.py and
tests/test_launcher.py.)"""

import hashlib
import subprocess
from array import array

import httpx
import openai
import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request, Sequence
from shared.sampling import SamplingParams
from tests.conftest import serve
from tests.tiny_models import hf_greedy


def test_an_api_key_guards_every_route_but_health_and_metrics(llama_dir, tmp_path):
    prompt = [5, 9, 13, 200]
    with serve(llama_dir, str(tmp_path), env={"PAGEDSERVE_API_KEY": "s3cret"}) as server:
        url = f"{server.base_url}/v1"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.get(f"{url}/models", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        for method, path, body in (("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [5]}),
                                   ("GET", "/version", None), ("GET", "/ping", None), ("POST", "/ping", None)):
            refused = httpx.request(method, f"{server.base_url}{path}", json=body)
            assert refused.status_code == 401, path
            allowed = httpx.request(method, f"{server.base_url}{path}", json=body,
                                    headers={"Authorization": "Bearer s3cret"})
            assert allowed.status_code == 200, path
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
