"""What a stranger can and cannot do: API keys on the OpenAI routes, prefix-cache keys no prompt can
forge. (The launcher's private socket directory and its removal: tests/test_stopping.py and
tests/test_launcher.py.)"""

import hashlib
import subprocess
from array import array

import httpx
import openai
import pytest

from services.scheduler.kv_cache_manager import KVCacheManager, PrefixMatch
from services.scheduler.request import Request, Sequence
from shared.sampling import SamplingParams
from tests.conftest import children, serve
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


def test_an_api_key_guards_every_route_but_health_and_metrics(llama_dir, tmp_path):
    prompt = [5, 9, 13, 200]
    with serve(llama_dir, str(tmp_path), "--api-key", "s3cret") as server:
        url = f"{server.base_url}/v1"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.get(f"{url}/models", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        for method, path, body in (
            ("POST", "/tokenize", {"prompt": "x"}),
            ("POST", "/detokenize", {"tokens": [5]}),
            ("GET", "/version", None),
            ("GET", "/ping", None),
            ("POST", "/ping", None),
        ):
            refused = httpx.request(method, f"{server.base_url}{path}", json=body)
            assert refused.status_code == 401, path
            allowed = httpx.request(
                method, f"{server.base_url}{path}", json=body, headers={"Authorization": "Bearer s3cret"}
            )
            assert allowed.status_code == 200, path
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong").completions.create(model=server.model, prompt=prompt)
        completion = openai.OpenAI(base_url=url, api_key="s3cret").completions.create(
            model=server.model, prompt=prompt, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
        )
        assert completion.choices[0].model_extra["token_ids"] == hf_greedy(llama_dir, prompt, 6)
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        assert httpx.get(f"{server.base_url}/metrics").status_code == 200
        # Given on the command line, the key left it (the launcher started again with it in its
        # environment), and no child was given it on theirs.
        assert "s3cret" not in " ".join(_command_lines(server.process.pid))
        assert "PAGEDSERVE_API_KEY or use --api-key-file" in server.log()  # and said how to keep it off
        # Only the api, which checks it, has it in its environment.
        holders = {name for name, pid in children(server.process.pid).items() if b"s3cret" in _environment(pid)}
        assert holders == {"api"}, holders


def _environment(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


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
    manager = KVCacheManager(16, 4, enable_prefix_caching=True)
    first = _sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    manager.start(first, PrefixMatch())
    manager.append_slots(first, 9)
    manager.mark_computed(first, 9)
    manager.cache_full_blocks(first)
    root = hashlib.sha256(array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert manager.device_pool.holds(root)
    assert manager.device_pool.holds(hashlib.sha256(root + array("q", [5, 6, 7, 8]).tobytes()).digest())
    hits = manager.match_prefix(_sequence([1, 2, 3, 4, 5, 6, 7, 8, 0]))
    assert hits == PrefixMatch.on_device(first.kv.block_table[:2])
    # The same second block after another first block is another key: no hit.
    assert manager.match_prefix(_sequence([0, 2, 3, 4, 5, 6, 7, 8, 0])) == PrefixMatch()


def test_tenants_and_cache_salts_find_only_their_own_prefixes_in_the_cache(llama_dir, tmp_path):
    # An attacker probing the prefix cache: which of these prompts has someone else sent?
    secret = "DB_PASSWORD = '5305' and the rest of a long shared configuration block " * 3
    keys = tmp_path / "keys"
    keys.write_text("alice-key\nmallory-key\n")
    with serve(llama_dir, str(tmp_path), "--enable-prefix-caching", "--api-key-file", str(keys)) as server:

        def cached(key: str, **fields) -> int:
            response = httpx.post(
                f"{server.base_url}/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": server.model, "prompt": secret, "max_tokens": 1, **fields},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("alice-key") == 0
        assert cached("mallory-key") == 0  # another tenant: alice's blocks are not found
        assert cached("mallory-key", cache_salt="alice-key") == 0  # nor by naming a salt
        assert cached("alice-key") > 0  # her own prompt is
        assert cached("alice-key", cache_salt="project-b") == 0  # a salt of her own parts her caches too
        assert cached("alice-key", cache_salt="project-b") > 0
        assert "alice-key" not in " ".join(_command_lines(server.process.pid))


def test_a_salt_roots_the_prefix_chain():
    salted = Sequence(0, Request("r", list(range(9)), SamplingParams(), 0.0, cache_salt="x"), 0)
    manager = KVCacheManager(16, 4, enable_prefix_caching=True)
    plain = _sequence(list(range(9)))
    assert manager._chain(plain, 2) != manager._chain(salted, 2)
    assert (
        manager._chain(salted, 2)[0]
        == hashlib.sha256(hashlib.sha256(b"cache_salt\0x").digest() + array("q", range(4)).tobytes()).digest()
    )


def test_the_api_key_can_come_from_the_environment(monkeypatch):
    from services.api.__main__ import build_parser
    from shared.cli import api_keys

    monkeypatch.setenv("PAGEDSERVE_API_KEY", "k1,k2")
    args = build_parser().parse_args(["--model", "m", "--scheduler-endpoint", "ipc:///x"])
    assert api_keys(args) == ["k1", "k2"]
