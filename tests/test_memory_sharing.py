"""Sharing KV blocks: greedy output does not depend on how memory is managed, and sharing saves blocks."""

import pytest

from tests.engine_harness import Engine
from tests.tiny_models import hf_greedy

PROMPTS = [[5, 9, 13, 200, 17], [7] * 23, list(range(20, 57)), [400, 3], list(range(100, 140, 3)), [11, 12] * 9]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def expected(llama_dir):
    return [hf_greedy(llama_dir, p, NEW_TOKENS) for p in PROMPTS]


def greedy(engine: Engine) -> list[list[int]]:
    return engine.generate(PROMPTS, max_tokens=NEW_TOKENS)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_greedy_output_does_not_depend_on_block_size(llama_dir, expected, block_size):
    assert greedy(Engine(llama_dir, block_size=block_size, num_gpu_blocks=4096 // block_size)) == expected


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_greedy_output_survives_many_preemptions(llama_dir, expected, mode):
    # 13 blocks of 4 tokens: the longest request alone needs 13; all six need 43.
    engine = Engine(llama_dir, block_size=4, num_gpu_blocks=13, num_cpu_blocks=64, preemption=mode)
    assert greedy(engine) == expected
    stats = engine.stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute >= 5
    if mode == "swap":
        assert stats.num_preemptions_swap >= 5 and stats.num_preemptions_recompute == 0
    if mode == "recompute":
        assert stats.num_preemptions_swap == 0


def test_a_full_swap_space_falls_back_to_recompute(llama_dir, expected):
    engine = Engine(llama_dir, block_size=4, num_gpu_blocks=13, num_cpu_blocks=3, preemption="swap")
    assert greedy(engine) == expected
    stats = engine.stats()
    assert stats.num_preemptions_recompute > 0 and stats.num_free_cpu_blocks == 3


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("chunked_prefill", [False, True])
def test_greedy_output_with_prefix_caching_and_chunked_prefill(llama_dir, expected, prefix_caching, chunked_prefill):
    engine = Engine(
        llama_dir,
        block_size=4,
        num_gpu_blocks=512,
        prefix_caching=prefix_caching,
        chunked_prefill=chunked_prefill,
        max_num_batched_tokens=16 if chunked_prefill else 512,
    )
    assert greedy(engine) == expected
    assert greedy(engine) == expected  # a second round finds the first round's blocks cached
    if prefix_caching:
        assert engine.stats().num_prompt_tokens_cached > 0


def test_chunked_prefill_splits_long_prompts_and_mixes_them_with_decodes(llama_dir, expected):
    engine = Engine(llama_dir, block_size=4, chunked_prefill=True, max_num_batched_tokens=8)
    scheduler = engine.scheduler
    ids = [engine.add(p, max_tokens=NEW_TOKENS) for p in PROMPTS]
    tokens: dict = {}
    mixed_steps = 0
    while (step := scheduler.schedule()) is not None:
        assert sum(e.num_tokens for e in step.scheduled) <= 8
        decoding = [e for e in step.scheduled if scheduler.sequences[e.seq_id].output_token_ids]
        prefilling = [e for e in step.scheduled if not scheduler.sequences[e.seq_id].output_token_ids]
        mixed_steps += bool(decoding and prefilling)
        for output in scheduler.update(engine.runner.execute(step)):
            tokens.setdefault(output.request_id, []).extend(output.sequences[0].token_ids)
    assert [tokens[i] for i in ids] == expected
    assert mixed_steps > 0  # prompt chunks ran in the same steps as decodes


def test_a_cached_prefix_is_not_computed_again(llama_dir):
    engine = Engine(llama_dir, block_size=4, prefix_caching=True)
    prefix = list(range(30, 70))  # ten full blocks
    first = engine.generate([prefix + [1, 2]], max_tokens=6)
    computed_before = engine.stats().num_prompt_tokens_computed
    second = engine.generate([prefix + [3, 4, 5]], max_tokens=6)
    computed = engine.stats().num_prompt_tokens_computed - computed_before
    assert computed == 3 + 0  # only the new tokens; the 40-token prefix came from the cache
    assert engine.stats().num_prompt_tokens_cached == 40
    uncached = Engine(llama_dir, block_size=4).generate([prefix + [3, 4, 5]], max_tokens=6)
    assert second == uncached and first != second


def test_parallel_samples_share_the_prompt_blocks(llama_dir):
    engine = Engine(llama_dir, block_size=4)
    prompt = list(range(40, 80))  # 10 blocks of prompt
    held = []

    def measure(engine):
        for request in engine.scheduler.running:
            physical = {b for seq in request.seqs for b in seq.kv.block_table}
            logical = sum(len(seq.kv.block_table) for seq in request.seqs)
            held.append((len(request.seqs), len(physical), logical))

    request_id = engine.add(prompt, n=4, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    tokens = engine.run(on_step=measure)[request_id]
    assert sorted(tokens) == [0, 1, 2, 3] and all(len(t) == 10 for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) > 1  # the samples differ
    forked = [h for h in held if h[0] == 4]
    assert forked and all(physical < logical for _, physical, logical in forked)
    # n independent requests would hold at least 4 x 10 prompt blocks; this one far fewer.
    assert max(physical for _, physical, _ in forked) < 4 * 10


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(llama_dir):
    engine = Engine(llama_dir, block_size=4)
    request_id = engine.add([5, 6, 7, 8, 9], n=2, best_of=5, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    scheduler = engine.scheduler
    finished = {}

    def remember(engine):
        request = engine.scheduler.requests.get(request_id)
        if request is not None:
            finished["seqs"] = list(request.seqs) + list(request.finished_seqs)

    tokens = engine.run(on_step=remember)[request_id]
    assert sorted(tokens) == [0, 1]
    candidates = sorted(finished["seqs"], key=lambda s: s.cumulative_logprob, reverse=True)
    assert len(candidates) == 5
    assert [tokens[0], tokens[1]] == [c.output_token_ids for c in candidates[:2]]
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_cached_prompt_tokens_are_counted_once_per_request_even_when_it_is_recomputed(llama_dir):
    engine = Engine(llama_dir, block_size=4, num_gpu_blocks=20, prefix_caching=True, preemption="recompute")
    prefix = list(range(30, 46))  # four full blocks, shared by every request
    prompts = [prefix + [i, i + 1] for i in range(200, 212, 2)]
    outputs = engine.generate(prompts, max_tokens=16)
    stats = engine.stats()
    assert stats.num_preemptions_recompute > 0  # some request resumed and found its blocks cached again
    assert 0 < stats.num_prompt_tokens_cached <= sum(len(p) for p in prompts)
    assert outputs == Engine(llama_dir, block_size=4).generate(prompts, max_tokens=16)


def test_kv_utilization_counts_shared_blocks_once_and_wastes_at_most_each_last_block(llama_dir):
    engine = Engine(llama_dir, block_size=4, num_gpu_blocks=256)
    engine.add(list(range(20, 38)), max_tokens=10, n=4, temperature=1.0, seed=3)  # 18 shared prompt tokens
    engine.add(list(range(60, 69)), max_tokens=10)
    seen = []

    def check(engine):
        stats = engine.stats()
        used = stats.num_used_gpu_blocks
        if used:
            slots = used * stats.block_size
            # Every referenced block is full except, at most, the last block of each live sequence.
            assert slots - (stats.block_size - 1) * stats.num_running <= stats.kv_slots_holding_tokens <= slots
            seen.append(stats.kv_slots_holding_tokens / slots)

    engine.run(on_step=check)
    assert seen and min(seen) > 0.5
    assert engine.stats().tokens_scheduled >= 18 + 9 + 4 * 9 + 9
