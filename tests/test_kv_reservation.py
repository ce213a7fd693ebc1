"""The reservation baselines: the same scheduler, with a request's KV memory held from its start."""

import pytest

from services.scheduler.scheduler import ConfigError
from tests.scheduler_harness import StandInWorker, check_block_accounting, make_scheduler, request, run_to_completion

# prompt 5 tokens, max_tokens 9, blocks of 4 slots, a context of 64 tokens
RESERVED_BLOCKS = {"paged": 2, "oracle": 4, "pow2": 6, "max": 16}  # 5 | 14 | 5 + 16 | 64 slots


def tokens_of(outputs):
    return {rid: [t for out in outs for d in out.sequences for t in d.token_ids] for rid, outs in outputs.items()}


@pytest.mark.parametrize("policy", RESERVED_BLOCKS)
def test_a_request_holds_its_reservation_from_its_first_step_and_never_grows(policy):
    scheduler, worker = make_scheduler(block_size=4, context=64, reservation=policy), StandInWorker()
    scheduler.add(request(prompt_len=5, max_tokens=9))
    scheduler.update(worker.run(scheduler.schedule()))
    seq = scheduler.running[0].seqs[0]
    assert len(seq.kv.block_table) == RESERVED_BLOCKS[policy]
    held = set()
    while scheduler.has_work():
        step = scheduler.schedule()
        held.add(len(seq.kv.block_table))
        scheduler.update(worker.run(step))
    assert held == ({2, 3, 4} if policy == "paged" else {RESERVED_BLOCKS[policy]})
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_reservation_changes_memory_only_never_the_tokens(policy):
    prompts = [dict(prompt_len=3 + i, max_tokens=4 + 3 * i) for i in range(6)]
    outputs = {}
    for name in ("paged", policy):
        scheduler = make_scheduler(num_blocks=40, block_size=4, context=64, reservation=name)
        for i, fields in enumerate(prompts):
            message = request(**fields)
            message.request_id = f"r{i}"
            scheduler.add(message)
        outputs[name] = tokens_of(run_to_completion(scheduler, StandInWorker()))
        check_block_accounting(scheduler)
        assert scheduler.kv_cache.num_free_blocks == 40
    assert outputs[policy] == outputs["paged"]


@pytest.mark.parametrize("policy, started", [("paged", 8), ("oracle", 6), ("pow2", 4), ("max", 1)])
def test_reserving_ahead_shrinks_the_batch_a_pool_can_hold(policy, started):
    scheduler = make_scheduler(num_blocks=24, block_size=4, context=64, max_num_seqs=8, reservation=policy)
    for _ in range(8):
        scheduler.add(request(prompt_len=5, max_tokens=9))
    step = scheduler.schedule()
    assert len(step.scheduled) == started


@pytest.mark.parametrize("policy, reserved, unused", [("paged", 3, 0), ("oracle", 9, 2), ("max", 9, 50)])
def test_stats_split_the_used_slots_into_tokens_reserved_and_unused(policy, reserved, unused):
    scheduler, worker = make_scheduler(block_size=4, context=64, reservation=policy), StandInWorker()
    scheduler.add(request(prompt_len=5, max_tokens=9))
    scheduler.update(worker.run(scheduler.schedule()))  # 5 prompt tokens computed; 14 in all by the end
    stats = scheduler.stats()
    used_slots = stats.num_used_gpu_blocks * stats.block_size
    assert (stats.kv_slots_holding_tokens, stats.kv_slots_reserved) == (5, reserved)
    assert used_slots - 5 - reserved == unused


def test_the_baselines_share_nothing():
    with pytest.raises(ConfigError, match="prefix caching"):
        make_scheduler(reservation="oracle", prefix_caching=True)
    scheduler = make_scheduler(reservation="pow2")
    rejected = scheduler.add(request(n=2))
    assert rejected is not None and "one sample only" in rejected.error
    assert scheduler.add(request()) is None


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_a_reservation_is_one_run_of_consecutive_blocks(policy):
    scheduler, worker = make_scheduler(num_blocks=40, block_size=4, context=64, reservation=policy), StandInWorker()
    for i in range(3):
        scheduler.add(request(prompt_len=3 + i, max_tokens=5 + 2 * i))
    scheduler.update(worker.run(scheduler.schedule()))
    for running in scheduler.running:
        table = running.seqs[0].kv.block_table
        assert table == list(range(table[0], table[0] + len(table)))


def test_free_blocks_in_runs_too_short_for_the_next_reservation_are_external_fragmentation():
    # 12 blocks of 4 slots, Oracle: a (2 blocks), b (6) and c (3) fill blocks 0-10; d needs 3.
    lengths = {"a": (4, 4), "b": (4, 20), "c": (4, 8), "d": (4, 8)}
    scheduler, worker = make_scheduler(num_blocks=12, block_size=4, context=64, reservation="oracle"), StandInWorker()
    for name, (prompt_len, max_tokens) in lengths.items():
        message = request(prompt_len=prompt_len, max_tokens=max_tokens)
        message.request_id = name
        scheduler.add(message)
    while "a" in scheduler.requests:
        scheduler.update(worker.run(scheduler.schedule()))
    # a's blocks 0-1 and block 11 are free: three blocks, but no run of three, so d waits.
    stats = scheduler.stats()
    assert [r.request_id for r in scheduler.waiting] == ["d"]
    assert stats.num_free_gpu_blocks == 3 and stats.kv_slots_fragmented == 3 * 4
    while "c" in scheduler.requests:
        scheduler.update(worker.run(scheduler.schedule()))
    scheduler.update(worker.run(scheduler.schedule()))
    assert [r.request_id for r in scheduler.running] == ["b", "d"]
    assert scheduler.running[1].seqs[0].kv.block_table == [8, 9, 10]
    assert scheduler.stats().kv_slots_fragmented == 0
    run_to_completion(scheduler, worker)
    check_block_accounting(scheduler)


def test_paging_has_no_external_fragmentation():
    scheduler, worker = make_scheduler(num_blocks=12, block_size=4, context=64), StandInWorker()
    for prompt_len, max_tokens in [(4, 4), (4, 20), (4, 8), (4, 8), (30, 4)]:
        scheduler.add(request(prompt_len=prompt_len, max_tokens=max_tokens))
    while scheduler.has_work():
        assert scheduler.stats().kv_slots_fragmented == 0
        scheduler.update(worker.run(scheduler.schedule()))


def test_reservations_fill_the_pool_to_the_last_block_as_they_never_grow_into_the_watermark():
    scheduler = make_scheduler(num_blocks=32, block_size=4, context=64, reservation="max", watermark=0.1)
    for _ in range(3):
        scheduler.add(request(prompt_len=5, max_tokens=9))
    assert len(scheduler.schedule().scheduled) == 2  # 16 blocks each: the whole pool
    assert scheduler.kv_cache.num_free_blocks == 0
