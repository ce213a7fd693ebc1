"""LoRA adapters (PEFT format) served on the base model: each adapter's greedy tokens equal HF
transformers with peft applying it, in batches that mix adapters and the base model, with the adapters
paged in and out of the KV pool."""

from __future__ import annotations

import pytest

from shared.lora import BaseShape, check_adapter
from shared.protocol import LoraRef
from tests.engine_harness import Engine
from tests.tiny_models import hf_greedy, hf_lora_greedy, make_lora_adapter

PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [8, 6, 4, 2, 7, 5, 3, 1, 9, 11, 13], [100, 3, 100, 3, 100]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all-rank8": make_lora_adapter(llama_dir, str(root / "a"), rank=8, seed=1),
        "attention-rank4": make_lora_adapter(llama_dir, str(root / "b"), rank=4, seed=2,
                                             targets=("q_proj", "v_proj", "o_proj")),
        "mlp-rslora": make_lora_adapter(llama_dir, str(root / "c"), rank=16, seed=3, use_rslora=True,
                                        targets=("gate_proj", "down_proj"), layers=[0]),
    }


def ref(llama_dir: str, name: str, path: str) -> LoraRef:
    spec = check_adapter(name, path, BaseShape.of_model_dir(llama_dir), max_rank=16)
    return LoraRef(spec.name, spec.path, spec.rank, list(spec.targets))


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
        expected.append(hf_lora_greedy(llama_dir, adapters[name], prompt, MAX_TOKENS) if name
                        else hf_greedy(llama_dir, prompt, MAX_TOKENS))
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
    assert "all-rank8" not in pages.on_device and pages.evictions == 1
    assert engine.generate([PROMPTS[0]], lora=lora, max_tokens=MAX_TOKENS) == first
    assert pages.loads == 2


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another_or_the_base(llama_dir, adapters):
    engine = Engine(llama_dir, block_size=4, prefix_caching=True, max_loras=2)
    prompt = PROMPTS[0] + PROMPTS[1]
    a, b = (ref(llama_dir, n, adapters[n]) for n in ("all-rank8", "attention-rank4"))
    assert engine.generate([prompt], lora=a, max_tokens=MAX_TOKENS) == [
        hf_lora_greedy(llama_dir, adapters["all-rank8"], prompt, MAX_TOKENS)]
    cached = engine.stats().num_prompt_tokens_cached
    assert engine.generate([prompt], lora=b, max_tokens=MAX_TOKENS) == [
        hf_lora_greedy(llama_dir, adapters["attention-rank4"], prompt, MAX_TOKENS)]
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
