"""LoRA adapters (PEFT format) served on the base model: each adapter's greedy tokens equal HF
transformers with peft applying it, in batches that mix adapters and the base model, with the adapters
paged in and out of the KV pool."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.config import SpeculativeConfig
from shared.lora import BaseShape, LoraError, check_adapter
from shared.protocol import LoraLoad, LoraRef
from tests.conftest import serve, wait_until
from tests.engine_harness import Engine
from tests.tiny_models import hf_greedy, hf_lora_generate, hf_lora_greedy, make_lora_adapter

PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [8, 6, 4, 2, 7, 5, 3, 1, 9, 11, 13], [100, 3, 100, 3, 100]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all-rank8": make_lora_adapter(llama_dir, str(root / "a"), rank=8, seed=1),
        "attention-rank4": make_lora_adapter(
            llama_dir, str(root / "b"), rank=4, seed=2, targets=("q_proj", "v_proj", "o_proj")
        ),
        "mlp-rslora": make_lora_adapter(
            llama_dir, str(root / "c"), rank=16, seed=3, use_rslora=True, targets=("gate_proj", "down_proj"), layers=[0]
        ),
    }


def ref(llama_dir: str, name: str, path: str) -> LoraRef:
    spec = check_adapter(name, path, BaseShape.of_model_dir(llama_dir), max_rank=16)
    return LoraRef(spec.name, spec.path, spec.rank, list(spec.targets), spec.digest)


def test_every_adapter_changes_the_tokens_as_peft_does(llama_dir, adapters):
    engine = Engine(llama_dir, block_size=4, max_loras=3)
    for name, path in adapters.items():
        expected = [hf_lora_greedy(llama_dir, path, p, MAX_TOKENS) for p in PROMPTS]
        assert engine.generate(PROMPTS, lora=ref(llama_dir, name, path), max_tokens=MAX_TOKENS) == expected
    base = [hf_greedy(llama_dir, p, MAX_TOKENS) for p in PROMPTS]
    assert engine.generate(PROMPTS, max_tokens=MAX_TOKENS) == base
    tuned = [hf_lora_greedy(llama_dir, adapters["all-rank8"], p, MAX_TOKENS) for p in PROMPTS]
    assert tuned != base  # the adapters are not no-ops


@pytest.mark.parametrize("depth", [1, 2], ids=["planned-after", "planned-ahead"])
def test_one_step_mixes_two_adapters_and_the_base_model(llama_dir, adapters, depth):
    engine = Engine(llama_dir, block_size=4, max_loras=2, depth=depth)
    names = ["all-rank8", "attention-rank4", None]
    ids, expected = [], []
    for i, prompt in enumerate(PROMPTS * 2):
        name = names[i % 3]
        lora = ref(llama_dir, name, adapters[name]) if name else None
        ids.append(engine.add(prompt, lora=lora, max_tokens=MAX_TOKENS))
        expected.append(
            hf_lora_greedy(llama_dir, adapters[name], prompt, MAX_TOKENS)
            if name
            else hf_greedy(llama_dir, prompt, MAX_TOKENS)
        )
    tokens = engine.run()
    assert [tokens[i][0] for i in ids] == expected
    assert any(len({e.seq_id for e in step.scheduled}) == 6 for step in engine.steps)  # all six in one step


def test_adapters_beyond_max_loras_wait_and_are_paged_in_and_out(llama_dir, adapters):
    engine = Engine(llama_dir, block_size=4, max_loras=1)
    ids, expected = [], []
    for name, path in list(adapters.items()) * 2:
        ids.append(engine.add(PROMPTS[0], lora=ref(llama_dir, name, path), max_tokens=MAX_TOKENS))
        expected.append(hf_lora_greedy(llama_dir, path, PROMPTS[0], MAX_TOKENS))
    tokens = engine.run()
    assert [tokens[i][0] for i in ids] == expected
    pages = engine.scheduler.kv_cache.adapters
    assert pages.loads >= 3 and pages.evictions >= 2
    assert len(pages.on_device) == 1


def test_an_idle_adapters_pages_are_evicted_for_kv_blocks_and_loaded_again(llama_dir, adapters):
    engine = Engine(llama_dir, block_size=4, num_gpu_blocks=40, max_loras=2)
    lora = ref(llama_dir, "all-rank8", adapters["all-rank8"])
    first = engine.generate([PROMPTS[0]], lora=lora, max_tokens=MAX_TOKENS)
    pages = engine.scheduler.kv_cache.adapters
    held = pages.pages_for(lora)
    assert pages.loads == 1 and held < 40
    long_prompt = list(range(3, 3 + 4 * (40 - held)))[:120]  # takes the blocks the idle adapter holds
    engine.generate([long_prompt], max_tokens=2)
    assert lora.key not in pages.on_device and pages.evictions == 1
    assert engine.generate([PROMPTS[0]], lora=lora, max_tokens=MAX_TOKENS) == first
    assert pages.loads == 2


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another_or_the_base(llama_dir, adapters):
    engine = Engine(llama_dir, block_size=4, prefix_caching=True, max_loras=2)
    prompt = PROMPTS[0] + PROMPTS[1]
    a, b = (ref(llama_dir, n, adapters[n]) for n in ("all-rank8", "attention-rank4"))
    assert engine.generate([prompt], lora=a, max_tokens=MAX_TOKENS) == [
        hf_lora_greedy(llama_dir, adapters["all-rank8"], prompt, MAX_TOKENS)
    ]
    cached = engine.stats().num_prompt_tokens_cached
    assert engine.generate([prompt], lora=b, max_tokens=MAX_TOKENS) == [
        hf_lora_greedy(llama_dir, adapters["attention-rank4"], prompt, MAX_TOKENS)
    ]
    assert engine.generate([prompt], max_tokens=MAX_TOKENS) == [hf_greedy(llama_dir, prompt, MAX_TOKENS)]
    assert engine.stats().num_prompt_tokens_cached == cached  # no hit across adapters or the base
    engine.generate([prompt], lora=a, max_tokens=MAX_TOKENS)
    assert engine.stats().num_prompt_tokens_cached > cached  # the same adapter hits its own blocks


def test_preempted_adapter_requests_keep_their_tokens(llama_dir, adapters):
    expected = [hf_lora_greedy(llama_dir, adapters["all-rank8"], p, 24) for p in PROMPTS]
    lora = ref(llama_dir, "all-rank8", adapters["all-rank8"])
    for mode in ("recompute", "swap"):
        engine = Engine(llama_dir, block_size=4, num_gpu_blocks=50, preemption=mode, max_loras=1)  # 31 are its pages
        assert engine.generate(PROMPTS, lora=lora, max_tokens=24) == expected
        stats = engine.stats()
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0, mode


def test_beams_samples_and_ngram_speculation_run_under_the_adapter(llama_dir, adapters):
    path = adapters["all-rank8"]
    lora = ref(llama_dir, "all-rank8", path)
    prompt = PROMPTS[0]
    beams = Engine(llama_dir, block_size=4, max_loras=1)
    request = beams.add(prompt, lora=lora, max_tokens=MAX_TOKENS, n=2, best_of=2, use_beam_search=True)
    got = beams.run()[request]
    expected = hf_lora_generate(llama_dir, path, prompt, MAX_TOKENS, num_beams=2, num_return_sequences=2)
    assert sorted(got.values()) == sorted(expected)
    samples = Engine(llama_dir, block_size=4, max_loras=1)
    request = samples.add(prompt, lora=lora, max_tokens=MAX_TOKENS, n=2)  # greedy: both samples are the greedy one
    assert list(samples.run()[request].values()) == [hf_lora_greedy(llama_dir, path, prompt, MAX_TOKENS)] * 2
    speculating = Engine(llama_dir, block_size=4, max_loras=1, speculative=SpeculativeConfig("ngram", 3, 1, 3))
    repetitive = [100, 3, 100, 3, 100, 3, 100, 3]
    assert speculating.generate([repetitive], lora=lora, max_tokens=12) == [
        hf_lora_greedy(llama_dir, path, repetitive, 12)
    ]


def test_a_draft_model_proposes_without_the_adapter_and_the_target_verifies_under_it(llama_dir, adapters):
    path = adapters["all-rank8"]
    lora = ref(llama_dir, "all-rank8", path)
    engine = Engine(
        llama_dir,
        block_size=4,
        max_loras=1,
        speculative=SpeculativeConfig("draft_model", 3, model=llama_dir, adaptive=False),
    )
    assert engine.generate(PROMPTS, lora=lora, max_tokens=12) == [
        hf_lora_greedy(llama_dir, path, p, 12) for p in PROMPTS
    ]
    speculation = engine.stats().speculation
    # The draft is the base model: it proposes the base's tokens, which the adapter keeps only in part.
    assert 0 < speculation.num_accepted_tokens < speculation.num_draft_tokens


def test_structured_outputs_hold_under_an_adapter(llama_dir, adapters):
    from services.api.structured import GrammarSpec
    from tests.test_structured_outputs import compiled, texts

    regex = compiled(llama_dir, GrammarSpec("regex", "[0-9]{3}-[a-z]{2}", "guided_regex"))
    lora = ref(llama_dir, "all-rank8", adapters["all-rank8"])
    engine = Engine(llama_dir, block_size=4, max_loras=1)
    tuned = engine.generate(PROMPTS, lora=lora, grammar=regex, max_tokens=30, temperature=1.0, seed=5)
    base = engine.generate(PROMPTS, grammar=regex, max_tokens=30, temperature=1.0, seed=5)
    for text in texts(llama_dir, tuned):
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha(), text
    assert tuned != base  # the adapter's distribution, masked by the grammar


def test_the_host_cache_and_the_disk_tier_keep_each_adapters_blocks_apart(llama_dir, adapters, tmp_path):
    """Prompts under two adapters and the base fill a small device pool, so their blocks go to the host
    cache and to files; a second round (and a restarted engine) loads each one's own blocks, never another's."""
    names = ["attention-rank4", "mlp-rslora", None]
    loras = {name: ref(llama_dir, name, adapters[name]) for name in names if name}
    prompt = [7 + j for j in range(20)]  # the same tokens under each: only the salt keeps them apart
    expected = [
        hf_lora_greedy(llama_dir, adapters[n], prompt, MAX_TOKENS) if n else hf_greedy(llama_dir, prompt, MAX_TOKENS)
        for n in names
    ]
    assert len({tuple(e) for e in expected}) == 3

    def tiered() -> Engine:
        return Engine(
            llama_dir,
            block_size=4,
            num_gpu_blocks=40,
            max_loras=1,
            prefix_caching=True,
            num_host_cache_blocks=64,
            kv_cache_dir=str(tmp_path),
            write_through=True,
        )

    def rounds(engine: Engine) -> list[list[int]]:
        return [engine.generate([prompt], lora=loras.get(n), max_tokens=MAX_TOKENS)[0] for n in names * 2]

    first = tiered()
    assert rounds(first) == expected * 2
    stats = first.stats()
    assert stats.blocks_loaded > 0 and stats.prefix_hits_host_tokens > 0  # adapter pages evicted cached blocks
    first.cache.disk.close()
    restarted = tiered()
    assert rounds(restarted) == expected * 2
    assert restarted.stats().blocks_read_from_disk >= 3 * 4  # each one's own four full blocks


def broken_adapter(tmp_path, llama_dir, kind: str) -> str:
    """An adapter directory with one thing wrong."""
    path = make_lora_adapter(llama_dir, str(tmp_path / kind), rank=4, seed=5)
    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    if kind == "missing-weights":
        os.remove(os.path.join(path, "adapter_model.safetensors"))
    elif kind == "rank-over-maximum":
        make_lora_adapter(llama_dir, path, rank=32, seed=5)
    elif kind == "unknown-target":
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        renamed = {name.replace("q_proj", "qkv_proj"): value for name, value in tensors.items()}
        save_file(renamed, os.path.join(path, "adapter_model.safetensors"))
    elif kind == "shapes-of-another-model":
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        save_file(
            {name: torch.cat([value, value], dim=-1) if "lora_A" in name else value for name, value in tensors.items()},
            os.path.join(path, "adapter_model.safetensors"),
        )
    elif kind == "not-lora":
        config["peft_type"] = "PREFIX_TUNING"
        with open(config_path, "w") as f:
            json.dump(config, f)
    elif kind == "offsets-that-lie":  # the header passes; the data it points at is not there
        weights = os.path.join(path, "adapter_model.safetensors")
        data = Path(weights).read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        name = next(n for n in header if n != "__metadata__")
        header[name]["data_offsets"][1] = header[name]["data_offsets"][0]  # no bytes for its shape
        encoded = json.dumps(header, separators=(",", ":")).encode()
        assert len(encoded) <= length
        with open(weights, "wb") as f:
            f.write(data[:8] + encoded.ljust(length) + data[8 + length :])
    elif kind == "not-finite":
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        name = next(iter(tensors))
        tensors[name][0, 0] = float("nan")
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


BAD_ADAPTERS = {
    "missing-weights": "no adapter_model.safetensors",
    "rank-over-maximum": "over this server's",
    "unknown-target": "target module qkv_proj",
    "shapes-of-another-model": "this base model needs",
    "not-lora": "only LORA adapters",
    "offsets-that-lie": "do not hold its",
    "not-finite": "not finite",
}


@pytest.mark.parametrize("kind", sorted(BAD_ADAPTERS))
def test_each_bad_adapter_is_refused_with_its_reason(llama_dir, tmp_path, kind):
    with pytest.raises(LoraError, match=BAD_ADAPTERS[kind]):
        check_adapter("bad", broken_adapter(tmp_path, llama_dir, kind), BaseShape.of_model_dir(llama_dir), 16)


def test_a_file_linked_out_of_the_lora_roots_is_refused(llama_dir, tmp_path):
    outside = make_lora_adapter(llama_dir, str(tmp_path / "outside"), rank=4, seed=5)
    inside = tmp_path / "roots" / "looks-fine"
    inside.mkdir(parents=True)
    os.symlink(os.path.join(outside, "adapter_model.safetensors"), inside / "adapter_model.safetensors")
    os.symlink(os.path.join(outside, "adapter_config.json"), inside / "adapter_config.json")
    base = BaseShape.of_model_dir(llama_dir)
    with pytest.raises(LoraError, match="leads outside the folders"):
        check_adapter("linked", str(inside), base, 16, roots=[str(tmp_path / "roots")])
    assert check_adapter("linked", str(inside), base, 16).digest  # where no roots bound it, the link is read


def test_an_adapter_is_known_by_its_files_so_a_name_loaded_again_with_others_shares_nothing(llama_dir, tmp_path):
    engine = Engine(llama_dir, block_size=4, prefix_caching=True, max_loras=2)
    prompt = [7 + j for j in range(16)]
    first = ref(llama_dir, "same-name", make_lora_adapter(llama_dir, str(tmp_path / "one"), rank=4, seed=11))
    engine.generate([prompt], lora=first, max_tokens=MAX_TOKENS)
    again = ref(llama_dir, "same-name", make_lora_adapter(llama_dir, str(tmp_path / "one"), rank=8, seed=12))
    assert first.name == again.name and first.key != again.key
    cached_before = engine.stats().prefix_hits_device_tokens
    assert engine.generate([prompt], lora=again, max_tokens=MAX_TOKENS) == [
        hf_lora_greedy(llama_dir, str(tmp_path / "one"), prompt, MAX_TOKENS)
    ]  # the second files' weights
    pages = engine.scheduler.kv_cache.adapters
    assert set(pages.on_device) == {first.key, again.key} and pages.loads == 2
    assert engine.stats().prefix_hits_device_tokens == cached_before  # nothing the first computed is found
    with pytest.raises(LoraError, match="files changed since it was loaded"):  # the worker checks them again
        engine.runner.adapters.load(
            LoraLoad(first.name, first.path, list(range(40, 40 + pages.pages_for(first))), first.key)
        )


def test_idle_adapters_keep_their_pages_while_the_pool_has_room(llama_dir, adapters):
    engine = Engine(llama_dir, block_size=4, num_gpu_blocks=256, max_loras=4)
    sql, chat = ref(llama_dir, "sql", adapters["all-rank8"]), ref(llama_dir, "chat", adapters["attention-rank4"])
    for lora in (sql, chat, sql, chat, sql):
        engine.generate([PROMPTS[0]], lora=lora, max_tokens=MAX_TOKENS)
    pages = engine.scheduler.kv_cache.adapters
    assert (pages.loads, pages.evictions, len(pages.on_device)) == (2, 0, 2)


@pytest.mark.slow
def test_a_server_serves_adapters_by_name_and_loads_and_unloads_them_at_run_time(llama_dir, adapters, tmp_path):
    key = "secret-key"
    roots = tmp_path / "allowed"
    roots.mkdir()
    later = make_lora_adapter(llama_dir, str(roots / "later"), rank=4, seed=7, targets=("k_proj", "up_proj"))
    flags = [
        "--block-size",
        "4",
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"tuned={adapters['all-rank8']}",
        json.dumps({"name": "attn", "path": adapters["attention-rank4"]}),
        "--allow-runtime-lora-updating",
        "--lora-roots",
        str(roots),
        "--api-key",
        key,
    ]
    headers = {"Authorization": f"Bearer {key}"}
    with serve(llama_dir, str(tmp_path), *flags) as server:

        def post(route, body, auth=True):
            return httpx.post(f"{server.base_url}{route}", json=body, headers=headers if auth else {}, timeout=60)

        def complete(model, prompt):
            response = post(
                "/v1/completions",
                {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "return_token_ids": True,
                },
            )
            assert response.status_code == 200, response.text
            assert response.json()["model"] == (model or server.model)  # the adapter, as vLLM names it
            return response.json()["choices"][0]["token_ids"]

        models = httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=10).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [
            (server.model, None),
            ("tuned", server.model),
            ("attn", server.model),
        ]
        assert complete("tuned", PROMPTS[0]) == hf_lora_greedy(llama_dir, adapters["all-rank8"], PROMPTS[0], MAX_TOKENS)
        assert complete("attn", PROMPTS[1]) == hf_lora_greedy(
            llama_dir, adapters["attention-rank4"], PROMPTS[1], MAX_TOKENS
        )
        assert complete(server.model, PROMPTS[0]) == hf_greedy(llama_dir, PROMPTS[0], MAX_TOKENS)
        card = httpx.get(f"{server.base_url}/v1/models/tuned", headers=headers, timeout=10).json()
        assert card["id"] == "tuned" and card["parent"] == server.model
        assert httpx.get(f"{server.base_url}/v1/models/nobody", headers=headers, timeout=10).status_code == 404
        assert post("/tokenize", {"model": "attn", "prompt": "def"}).json()["count"] > 0
        unknown = post("/v1/completions", {"model": "nobody", "prompt": "hi", "max_tokens": 2})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

        assert post("/v1/load_lora_adapter", {"lora_name": "later", "lora_path": later}, auth=False).status_code == 401
        outside = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["all-rank8"]})
        assert outside.status_code == 400 and "outside the folders" in outside.json()["error"]["message"]
        loaded = post("/v1/load_lora_adapter", {"lora_name": "later", "lora_path": later})
        assert loaded.status_code == 200, loaded.text
        assert complete("later", PROMPTS[2]) == hf_lora_greedy(llama_dir, later, PROMPTS[2], MAX_TOKENS)
        again = post("/v1/load_lora_adapter", {"lora_name": "later", "lora_path": later})
        assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
        for kind, reason in BAD_ADAPTERS.items():
            path = broken_adapter(roots, llama_dir, kind)
            bad = post("/v1/load_lora_adapter", {"lora_name": kind, "lora_path": path})
            assert bad.status_code == 400 and reason in bad.json()["error"]["message"], bad.text
        assert post("/v1/unload_lora_adapter", {"lora_name": "later"}).status_code == 200
        assert post("/v1/completions", {"model": "later", "prompt": "hi", "max_tokens": 2}).status_code == 404
        assert post("/v1/unload_lora_adapter", {"lora_name": "later"}).status_code == 404
        assert complete("tuned", PROMPTS[0]) == hf_lora_greedy(llama_dir, adapters["all-rank8"], PROMPTS[0], MAX_TOKENS)
        metrics = server.metrics("scheduler")
        assert metrics['pagedserve_lora_requests_total{adapter="tuned"}'] == 2
        assert metrics['pagedserve_lora_requests_total{adapter="base"}'] == 1
        assert metrics['pagedserve_lora_adapter_loads_total{event="load"}'] >= 4  # tuned twice: three with room for 2
        assert metrics['pagedserve_lora_adapter_loads_total{event="eviction"}'] >= 2
        assert metrics["pagedserve_lora_adapters"] <= 2 and metrics["pagedserve_lora_pages"] > 0


@pytest.mark.slow
def test_a_tenant_sees_uses_and_unloads_only_its_own_adapters_and_the_shared_ones_need_the_admin(
    llama_dir, adapters, tmp_path
):
    roots = tmp_path / "allowed"
    roots.mkdir()
    ones = make_lora_adapter(llama_dir, str(roots / "a-mine"), rank=4, seed=21, targets=("q_proj", "v_proj"))
    others = make_lora_adapter(llama_dir, str(roots / "b-mine"), rank=8, seed=22, targets=("o_proj", "up_proj"))
    (tmp_path / "admin").write_text("the-admin-key\n")
    flags = [
        "--block-size",
        "4",
        "--enable-lora",
        "--max-loras",
        "3",
        "--lora-modules",
        f"tuned={adapters['all-rank8']}",
        "--allow-runtime-lora-updating",
        "--lora-roots",
        str(roots),
        "--api-key",
        "key-a,key-b",
        "--admin-api-key-file",
        str(tmp_path / "admin"),
    ]
    with serve(llama_dir, str(tmp_path), *flags) as server:

        def call(key, route, body=None):
            headers = {"Authorization": f"Bearer {key}"}
            if body is None:
                return httpx.get(f"{server.base_url}{route}", headers=headers, timeout=60)
            return httpx.post(f"{server.base_url}{route}", json=body, headers=headers, timeout=60)

        def complete(key, model):
            return call(
                key,
                "/v1/completions",
                {
                    "model": model,
                    "prompt": PROMPTS[0],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "return_token_ids": True,
                },
            )

        def models(key):
            return sorted(m["id"] for m in call(key, "/v1/models").json()["data"])

        assert call("key-a", "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": ones}).status_code == 200
        assert models("key-a") == sorted([server.model, "tuned", "mine"]) and "mine" not in models("key-b")
        assert complete("key-b", "mine").status_code == 404  # A's adapter is not B's to use
        assert call("key-b", "/v1/unload_lora_adapter", {"lora_name": "mine"}).status_code == 404
        assert call("key-b", "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": others}).status_code == 200
        tokens = {key: complete(key, "mine").json()["choices"][0]["token_ids"] for key in ("key-a", "key-b")}
        assert tokens == {
            "key-a": hf_lora_greedy(llama_dir, ones, PROMPTS[0], MAX_TOKENS),
            "key-b": hf_lora_greedy(llama_dir, others, PROMPTS[0], MAX_TOKENS),
        }
        assert call("key-b", "/v1/unload_lora_adapter", {"lora_name": "mine"}).status_code == 200
        assert complete("key-a", "mine").json()["choices"][0]["token_ids"] == tokens["key-a"]
        refused = call("key-a", "/v1/unload_lora_adapter", {"lora_name": "tuned"})
        assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
        assert complete("key-b", "tuned").status_code == 200
        assert call("the-admin-key", "/v1/unload_lora_adapter", {"lora_name": "tuned"}).status_code == 200
        assert complete("key-b", "tuned").status_code == 404


@pytest.mark.slow
def test_an_adapter_whose_files_went_away_fails_its_request_alone_and_another_stream_goes_on(llama_dir, tmp_path):
    roots = tmp_path / "allowed"
    roots.mkdir()
    gone = make_lora_adapter(llama_dir, str(roots / "gone"), rank=4, seed=3, targets=("q_proj", "v_proj"))
    flags = ["--block-size", "4", "--enable-lora", "--allow-runtime-lora-updating", "--lora-roots", str(roots)]
    with serve(llama_dir, str(tmp_path), *flags) as server:
        base = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        expected = httpx.post(f"{server.base_url}/v1/completions", json=base, timeout=120).json()["choices"][0]["text"]
        loaded = httpx.post(
            f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": gone}, timeout=60
        )
        assert loaded.status_code == 200, loaded.text
        for name in os.listdir(gone):  # checked when loaded, gone when the worker reads it
            os.unlink(os.path.join(gone, name))
        streamed: list[str] = []

        def stream() -> None:
            with httpx.stream(
                "POST", f"{server.base_url}/v1/completions", json={**base, "stream": True}, timeout=120
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        streamed.append(json.loads(line.removeprefix("data: "))["choices"][0]["text"])

        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(stream)
            assert wait_until(lambda: len(streamed) >= 5, 60)
            failed = httpx.post(
                f"{server.base_url}/v1/completions",
                timeout=60,
                json={"model": "gone", "prompt": PROMPTS[1], "max_tokens": 4},
            )
            streaming.result(120)
        assert failed.status_code == 400 and "could not be loaded" in failed.json()["error"]["message"], failed.text
        assert "".join(streamed) == expected  # computed again where the failed step left it: the same text
        after = httpx.post(f"{server.base_url}/v1/completions", json=base, timeout=120)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
# Triton's kernel reads every adapter through its page table, consecutive pages being no special case for it.
@pytest.mark.parametrize(
    "kernel, scattered",
    [("c", False), ("c", True), ("triton", True)],
    ids=["compiled", "compiled-scattered", "triton-scattered"],
)
def test_each_kernel_adds_what_torchs_products_add(llama_dir, adapters, weights, kernel, scattered):
    """The compiled kernel (a CPU's) and the Triton one (CUDA's, run here by Triton's interpreter) against
    torch's products, with each adapter's pages consecutive or with no two consecutive (the compiled kernel
    and torch then read a gathered copy, the Triton kernel the pages where they are)."""
    from services.worker import lora_kernels

    if kernel == "c" and lora_kernels.lora_kernel() is None:
        pytest.skip("no C compiler here")
    engine = Engine(llama_dir, block_size=4, max_loras=3)
    runner, pages = engine.runner.adapters, engine.scheduler.kv_cache.adapters
    # The adapters' values in the KV cache's memory in `weights`, as a model of that dtype keeps them.
    runner.dtype = weights
    runner.half_elements = pages.half_elements = runner.half_bytes // torch.empty((), dtype=weights).element_size()
    segments = []
    for i, (name, path) in enumerate(adapters.items()):
        pages.acquire(f"r{i}", ref(llama_dir, name, path))
        [load] = pages.take_loads()
        if scattered:
            load.pages = load.pages[1::2] + load.pages[::2]
        runner.load(load)
        segments.append((load.key, [3 * i + j for j in range(i + 1)]))  # 1, 2 and 3 rows
    torch.manual_seed(0)
    for group in lora_kernels.GROUPS:
        x = torch.randn(9, runner.dims[group[0]][0])
        base = torch.randn(9, sum(runner.dims[p][1] for p in group))
        in_kernel, in_torch = base.clone(), base.clone()
        runner.kernel = kernel
        batched = runner.batch(segments)
        assert batched.kernel is not None and not batched.segments  # every adapter through the kernel
        churn = [torch.full((n,), float("nan")) for n in (1 << 10, 1 << 14, 1 << 16, 1 << 18) for _ in range(8)]
        del churn  # memory freed by the batch's making is used and filled again before the kernel reads it
        batched.add(1, group, x, in_kernel)
        runner.kernel = None  # every adapter through torch's products
        unbatched = runner.batch(segments)
        assert unbatched.kernel is None and len(unbatched.segments) == 3
        unbatched.add(1, group, x, in_torch)
        assert not torch.equal(in_torch, base)
        torch.testing.assert_close(in_kernel, in_torch, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_tensor_parallel_ranks_apply_their_shard_of_each_adapter(llama_dir, adapters, tmp_path):
    """Column-parallel projections take their rows of B, row-parallel ones their columns of A, added before
    the ranks' partial sums are reduced; two adapters and the base model in the same steps."""
    flags = [
        "--tensor-parallel-size",
        "2",
        "--block-size",
        "4",
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"tuned={adapters['all-rank8']}",
        f"attn={adapters['attention-rank4']}",
    ]
    models = ["tuned", "attn", None] * 2
    with serve(llama_dir, str(tmp_path), *flags) as server:

        def complete(model, prompt):
            body = {
                "model": model or server.model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            }
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == (model or server.model)  # the adapter, as vLLM names it
            return response.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(6) as pool:  # at once: mixed steps
            got = list(pool.map(complete, models, PROMPTS * 2))
    paths = {"tuned": adapters["all-rank8"], "attn": adapters["attention-rank4"]}
    assert got == [
        hf_lora_greedy(llama_dir, paths[m], p, MAX_TOKENS) if m else hf_greedy(llama_dir, p, MAX_TOKENS)
        for m, p in zip(models, PROMPTS * 2)
    ]


def test_routing_and_cache_keys_differ_by_adapter():
    from services.api.routing import EngineLoad, Router
    from shared.prefix_keys import routing_key, salted_root

    tokens = list(range(64))
    assert routing_key(tokens, 4, "", "a") != routing_key(tokens, 4, "", "b") != routing_key(tokens, 4)
    assert salted_root("", "a") != salted_root("a") and salted_root("s", "a") != salted_root("s", "b")
    # An engine that caches the base model's prefix is no holder of the adapter's.
    base_key = routing_key(tokens, 4)[:8]
    engines = [EngineLoad("e0", 0, 0, 0, 0.0, frozenset({base_key})), EngineLoad("e1", 0, 0, 0, 0.0)]
    router = Router("prefix")
    assert router.choose(engines, tokens, 4) == 0
    chosen = {Router("prefix").choose(engines, tokens, 4, "", name) for name in ("a", "b", "c", "d", "e", "f")}
    assert chosen == {0, 1}  # the adapters' keys spread by rendezvous, not all to the base's holder
