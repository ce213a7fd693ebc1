"""Async scheduling: the scheduler plans step n+1 while step n is still on the worker.

The worker appends the token it samples for a plain sequence itself, so a step planned ahead can
schedule the position of a token the scheduler has not seen yet. What may not be planned ahead
waits for its result, and nothing is preempted while a step is in flight.
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.protocol import AddRequest
from shared.sampling import SamplingParams
from tests.scheduler_harness import (
    EOS,
    StandInWorker,
    check_block_accounting,
    make_scheduler,
    request,
    run_to_completion,
)
from tests.test_liveness import _build, configs


def test_a_decode_is_planned_before_the_previous_result_is_in():
    scheduler, worker = make_scheduler(block_size=4), StandInWorker()
    scheduler.add(request(prompt_len=4, max_tokens=3))
    prompt = scheduler.schedule()
    ahead = scheduler.schedule()  # the prompt's step has not run yet
    entry = ahead.scheduled[0]
    assert (entry.start, entry.num_tokens, entry.appended_token_ids) == (4, 1, [])
    assert len(entry.block_ids) == 1  # the slot of the token the prompt's step will sample
    scheduler.update(worker.run(prompt))
    scheduler.update(worker.run(ahead))
    assert worker.tokens[entry.seq_id] == [1, 2, 3, 4, 104, 105]
    seq = scheduler.sequences[entry.seq_id]
    assert seq.output_token_ids == [104, 105] and seq.num_pending == 0 and seq.kv.num_computed == 5


def test_samples_that_decide_what_comes_next_wait_for_their_result():
    scheduler = make_scheduler(block_size=4)
    for sampling in ({"use_beam_search": True, "best_of": 2}, {"n": 2}, {"max_tokens": 1}):
        scheduler.add(request(prompt_len=4, **{"max_tokens": 3, **sampling}))
    prompts = scheduler.schedule()
    assert len(prompts.scheduled) == 3
    # Beams are chosen by the scheduler, n=2 forks on its first sample, max_tokens=1 ends on it.
    assert scheduler.schedule() is None


def test_a_stop_token_wastes_one_position_and_frees_everything():
    scheduler = make_scheduler(block_size=4)
    worker = StandInWorker(lambda seq_id, position: EOS if position == 5 else 100 + position)
    scheduler.add(request(prompt_len=4, max_tokens=10))
    steps = [scheduler.schedule(), scheduler.schedule()]
    outputs = scheduler.update(worker.run(steps[0]))  # samples 104
    steps.append(scheduler.schedule())
    outputs += scheduler.update(worker.run(steps[1]))  # samples EOS: the request ends
    assert outputs[-1].finished and outputs[-1].sequences[0].finish_reason == "stop"
    outputs += scheduler.update(worker.run(steps[2]))  # computed the position after EOS: ignored
    assert [t for o in outputs for d in o.sequences for t in d.token_ids] == [104, EOS]
    assert not scheduler.has_work()
    check_block_accounting(scheduler)
    assert scheduler.kv_cache.device_pool.num_referenced == 0


def test_nothing_is_preempted_while_a_step_is_in_flight():
    # Two requests fill the 4-block pool; each needs a third block at its 9th token.
    scheduler, worker = make_scheduler(num_blocks=4, block_size=4, preemption="recompute"), StandInWorker()
    first, second = request(prompt_len=7, max_tokens=6), request(prompt_len=7, max_tokens=6)
    scheduler.add(first)
    scheduler.add(second)
    in_flight = [scheduler.schedule()]
    while True:
        step = scheduler.schedule()  # always planned ahead: one step is in flight
        if step is not None:
            assert step.preempted_seq_ids == [] and step.transfers == []
            in_flight.append(step)
        if scheduler.needs_drain:
            break
        scheduler.update(worker.run(in_flight.pop(0)))
    assert scheduler.counters.preemptions_recompute == 0
    while in_flight:  # drain, as the server does
        scheduler.update(worker.run(in_flight.pop(0)))
    step = scheduler.schedule()
    assert step.preempted_seq_ids == [1]  # the later arrival makes room, as without planning ahead
    assert [e.seq_id for e in step.scheduled] == [0]


@st.composite
def plain_requests(draw):
    """Requests whose tokens depend only on their positions: the same however steps are timed."""
    kind = draw(st.sampled_from([{}, {"n": 2}, {"n": 1, "best_of": 3}, {"stop_token_ids": [109]}]))
    prompt = draw(st.sampled_from([[], [5, 6, 7, 8, 9, 10, 11, 12]])) + draw(
        st.lists(st.integers(1, 30), min_size=1, max_size=30)
    )
    return prompt, dict(kind, max_tokens=draw(st.integers(1, 30)))


def _positional(seq_id: int, position: int) -> int:
    return EOS if position % 13 == 0 else 100 + position


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), specs=st.lists(plain_requests(), min_size=1, max_size=8))
def test_planning_ahead_gives_the_tokens_of_planning_after_each_result(config, specs):
    results = []
    for depth in (1, 2):
        scheduler = _build(config)
        admitted = [
            i
            for i, (prompt, sampling) in enumerate(specs)
            if scheduler.add(AddRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, **sampling), float(i))) is None
        ]
        outputs = run_to_completion(scheduler, StandInWorker(_positional), depth=depth)
        assert not scheduler.has_work() and scheduler.kv_cache.device_pool.num_referenced == 0
        tokens = {}
        for request_id, updates in outputs.items():
            assert updates[-1].finished and updates[-1].error is None
            for update in updates:
                for delta in update.sequences:
                    tokens.setdefault((request_id, delta.index), []).extend(delta.token_ids)
        assert {r for r, _ in tokens} == {f"r{i}" for i in admitted}
        results.append(tokens)
    assert results[0] == results[1]


def test_prompts_arriving_one_by_one_while_a_step_computes_start_together_in_the_next_step():
    """A burst reaches the scheduler a request at a time. A step planned ahead leaves prompts that do not fill
    its budget for the step after the one computing, however many plans their arrivals prompt meanwhile; so
    they run in one full step instead of a small one queued ahead of the rest."""
    scheduler, worker = make_scheduler(block_size=4, max_tokens_per_step=64), StandInWorker()
    scheduler.add(request(prompt_len=16, max_tokens=1))
    computing = scheduler.schedule()  # nothing computes: the first prompt starts at once, alone
    assert [e.num_tokens for e in computing.scheduled] == [16]
    for _ in range(3):  # each arrival prompts a plan while that step computes
        scheduler.add(request(prompt_len=16, max_tokens=1))
        assert scheduler.schedule() is None
    scheduler.update(worker.run(computing))
    together = scheduler.schedule()
    assert [e.num_tokens for e in together.scheduled] == [16, 16, 16]


def test_a_prompt_left_out_of_a_step_planned_ahead_waits_no_longer_than_the_step_then_computing():
    scheduler, worker = make_scheduler(block_size=4, max_tokens_per_step=64), StandInWorker()
    scheduler.add(request(prompt_len=4, max_tokens=50))
    in_flight = deque([scheduler.schedule(), scheduler.schedule()])  # its prompt, and its first decode ahead
    scheduler.add(request(prompt_len=4, max_tokens=2))  # far from filling a step
    scheduler.update(worker.run(in_flight.popleft()))
    left_out = scheduler.schedule()  # planned ahead of the decode computing: the prompt waits for it
    assert [e.num_tokens for e in left_out.scheduled] == [1]
    in_flight.append(left_out)
    scheduler.update(worker.run(in_flight.popleft()))  # the decode it waited for is done
    assert sorted(e.num_tokens for e in scheduler.schedule().scheduled) == [1, 4]
