"""Beam search in the scheduler returns HF transformers' beams, sharing blocks between beams."""

import pytest

from tests.engine_harness import Engine
from tests.tiny_models import hf_beam_search

PROMPTS = [[5, 9, 13, 200, 17], list(range(20, 45)), [400, 3]]


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_beams_equal_hf_generate_num_beams(model_dirs, family, width):
    model_dir = model_dirs[family]
    engine = Engine(model_dir, block_size=4)
    ids = [engine.add(p, use_beam_search=True, best_of=width, n=width, max_tokens=10) for p in PROMPTS]
    tokens = engine.run()
    for request_id, prompt in zip(ids, PROMPTS):
        got = [tokens[request_id][i] for i in range(width)]
        assert got == hf_beam_search(model_dir, prompt, width, 10)


@pytest.mark.parametrize(
    "options", [dict(length_penalty=0.5), dict(early_stopping=True), dict(early_stopping="never", length_penalty=2.0)]
)
def test_length_penalty_and_early_stopping_follow_hf(llama_dir, options):
    engine = Engine(llama_dir, block_size=4)
    prompt = PROMPTS[0]
    request_id = engine.add(prompt, use_beam_search=True, best_of=3, n=3, max_tokens=12, **options)
    got = engine.run()[request_id]
    assert [got[i] for i in range(3)] == hf_beam_search(llama_dir, prompt, 3, 12, **options)


def test_beams_share_blocks_and_free_them_all_at_the_end(llama_dir):
    engine = Engine(llama_dir, block_size=4)
    shared = []

    def measure(engine):
        for request in engine.scheduler.running:
            if len(request.seqs) > 1:
                physical = {b for seq in request.seqs for b in seq.kv.block_table}
                shared.append(len(physical) < sum(len(seq.kv.block_table) for seq in request.seqs))

    engine.add(list(range(20, 45)), use_beam_search=True, best_of=4, n=4, max_tokens=10)
    engine.run(on_step=measure)
    assert shared and all(shared)
    manager = engine.scheduler.kv_cache
    assert manager.num_free_blocks == manager.num_blocks


def test_beam_search_survives_preemption(llama_dir):
    prompt = list(range(20, 45))
    expected = hf_beam_search(llama_dir, prompt, 4, 10)
    for mode in ("swap", "recompute"):
        engine = Engine(llama_dir, block_size=4, num_gpu_blocks=18, num_cpu_blocks=64, preemption=mode)
        ids = [engine.add(prompt, use_beam_search=True, best_of=4, n=4, max_tokens=10) for _ in range(2)]
        tokens = engine.run()
        stats = engine.stats()
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
        for request_id in ids:
            assert [tokens[request_id][i] for i in range(4)] == expected
