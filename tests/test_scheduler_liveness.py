"""The policy's promises, one scenario each: FCFS across swap and recompute, sequence budgets
that count forks, admission by worst case, start-up checks, and a bounded blast radius."""

import pytest

from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Budgets, ConfigError
from shared.protocol import AddRequest, StepResult
from shared.sampling import SamplingParams
from tests.scheduler_harness import StandInWorker, check_block_accounting, make_scheduler, request


def _step(scheduler, worker):
    step = scheduler.schedule()
    assert step is not None
    outputs = scheduler.update(worker.run(step))
    check_block_accounting(scheduler)
    return step, outputs


def test_resumption_serves_the_earliest_arrival_across_swap_and_recompute():
    # Room for about one growing request; swap space for one, so a second victim is recomputed.
    scheduler, worker = (
        make_scheduler(num_blocks=8, block_size=4, num_cpu_blocks=4, preemption="swap", max_tokens_per_step=64),
        StandInWorker(),
    )
    for i in range(4):
        scheduler.add(request(prompt_len=4, max_tokens=20, arrival=i))
    while scheduler.has_work():
        _step(scheduler, worker)
        # Everything running arrived before everything swapped or waiting: the earliest come back first.
        if scheduler.running and (scheduler.waiting or scheduler.swapped):
            assert max(r.order for r in scheduler.running) < min(
                r.order for r in [*scheduler.waiting, *scheduler.swapped]
            )
        assert [r.order for r in scheduler.swapped] == sorted(r.order for r in scheduler.swapped)
        assert [r.order for r in scheduler.waiting] == sorted(r.order for r in scheduler.waiting)
    assert scheduler.counters.preemptions_swap >= 1 and scheduler.counters.preemptions_recompute >= 1


def test_a_waiting_request_never_overtakes_an_earlier_swapped_one():
    scheduler, worker = (
        make_scheduler(num_blocks=8, block_size=4, num_cpu_blocks=16, preemption="swap", max_tokens_per_step=64),
        StandInWorker(),
    )
    early, late = request(prompt_len=8, max_tokens=16), request(prompt_len=8, max_tokens=16)
    scheduler.add(early)
    scheduler.add(late)
    while not scheduler.swapped:
        _step(scheduler, worker)
    newcomer = request(prompt_len=2, max_tokens=2)
    scheduler.add(newcomer)
    while scheduler.swapped:
        _step(scheduler, worker)
        if scheduler.swapped:  # the newcomer may start in the very step the swapped one returns
            assert scheduler.requests[newcomer.request_id].status is RequestStatus.WAITING
    while scheduler.has_work():
        _step(scheduler, worker)


def test_a_swapped_request_that_cannot_come_back_is_recomputed():
    # 4 blocks of 4: a request near the context limit holds all of them, and swapping in wants
    # one more block of room than the pool has.
    scheduler, worker = (
        make_scheduler(
            num_blocks=4, block_size=4, num_cpu_blocks=8, preemption="swap", max_tokens_per_step=16, context=16
        ),
        StandInWorker(),
    )
    long, short = request(prompt_len=12, max_tokens=3), request(prompt_len=3, max_tokens=9)
    scheduler.add(long)
    scheduler.add(short)
    for _ in range(100):
        if not scheduler.has_work():
            break
        _step(scheduler, worker)
    assert not scheduler.has_work()
    assert scheduler.kv_cache.swap_pool.num_referenced == 0


def test_a_request_alone_that_cannot_copy_its_shared_block_is_recomputed_at_once():
    # One prompt token, four samples: each needs its own copy of the shared block (5 blocks)
    # in a pool of 4. Swapping it out and back in would change nothing; recomputing unshares it.
    scheduler, worker = (
        make_scheduler(num_blocks=4, block_size=4, num_cpu_blocks=8, preemption="swap", context=4),
        StandInWorker(),
    )
    scheduler.add(request(prompt_len=1, max_tokens=2, n=4))
    steps = [_step(scheduler, worker)[0] for _ in range(2)]
    assert steps[1].preempted_seq_ids == [0, 1, 2, 3]  # dropped and started again in the same step
    assert [n.seq_id for n in steps[1].new_sequences] == [0, 1, 2, 3]
    assert (scheduler.counters.preemptions_swap, scheduler.counters.preemptions_recompute) == (0, 1)
    assert not scheduler.has_work()


def test_max_num_seqs_counts_the_samples_a_request_will_fork():
    scheduler, worker = make_scheduler(max_num_seqs=4), StandInWorker()
    for _ in range(4):
        scheduler.add(request(prompt_len=3, max_tokens=5, n=2, best_of=4, seed=1))
    most = 0
    while scheduler.has_work():
        _step(scheduler, worker)
        most = max(most, sum(len(r.seqs) for r in scheduler.running))
    assert most == 4  # one request of 4 samples at a time, never 16


def test_admission_rejects_a_request_whose_samples_could_outgrow_the_pool():
    scheduler = make_scheduler(num_blocks=10, block_size=4, context=64)
    rejected = scheduler.add(request(prompt_len=4, max_tokens=20, n=4))
    assert rejected is not None and "KV blocks" in rejected.error
    assert scheduler.add(request(prompt_len=4, max_tokens=20)) is None  # one sample fits
    assert scheduler.add(request(prompt_len=4, max_tokens=4, n=4)) is None  # short samples fit


def test_start_up_rejects_budgets_that_could_never_recompute_a_full_length_request():
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        Budgets(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048, chunked_prefill=False).check()
    Budgets(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048, chunked_prefill=True).check()


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**63),
        ("seed", 2**64),
        ("temperature", float("nan")),
        ("length_penalty", 5000.0),
        ("stop_token_ids", [2**63]),
        ("n", 2**64),
        ("logprobs", 10**6),
        ("max_tokens", 0),
    ],
)
def test_the_scheduler_validates_requests_whoever_sent_them(field, value):
    scheduler = make_scheduler()
    params = SamplingParams(temperature=0.0)
    setattr(params, field, value)
    rejected = scheduler.add(AddRequest("bad", [1, 2, 3], params, 0.0))
    assert rejected is not None and rejected.sequences[0].finish_reason == "rejected"
    assert field in rejected.error and not scheduler.has_work()
    assert scheduler.add(AddRequest("bad-ids", [-1, 2], SamplingParams(), 0.0)) is not None


def test_tiny_temperatures_are_served_as_greedy():
    scheduler = make_scheduler()
    params = SamplingParams(temperature=1e-39)
    assert scheduler.add(AddRequest("r", [1, 2, 3], params, 0.0)) is None
    assert params.temperature == 0.0 and params.greedy


def test_a_sequence_the_worker_refuses_fails_only_its_own_request():
    scheduler, worker = make_scheduler(), StandInWorker()
    good, bad = request(max_tokens=3), request(max_tokens=3)
    scheduler.add(good)
    scheduler.add(bad)
    step = scheduler.schedule()
    result = worker.run(step)
    bad_seq = scheduler.requests[bad.request_id].seqs[0].seq_id
    result = StepResult(
        result.step_id,
        [s for s in result.sampled if s.seq_id != bad_seq],
        0.0,
        0.0,
        failures={bad_seq: "a token id outside the vocabulary"},
    )
    outputs = {o.request_id: o for o in scheduler.update(result)}
    assert outputs[bad.request_id].finished and "vocabulary" in outputs[bad.request_id].error
    assert not outputs[good.request_id].finished
    while scheduler.has_work():
        _step(scheduler, worker)
    assert scheduler.kv_cache.device_pool.num_referenced == 0


def test_beam_search_keeps_only_live_beams():
    scheduler, worker = make_scheduler(num_blocks=512, context=256, max_tokens_per_step=256), StandInWorker()
    beam = request(prompt_len=4, max_tokens=60, use_beam_search=True, best_of=4, n=1, ignore_eos=True)
    scheduler.add(beam)
    held = []
    while scheduler.has_work():
        _step(scheduler, worker)
        live = scheduler.requests.get(beam.request_id)
        if live is not None:
            held.append(len(live.seqs) + len(live.finished_seqs))
    assert max(held) <= 4
