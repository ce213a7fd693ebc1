"""The scheduling policy, driven step by step without a worker."""

from tests.scheduler_harness import EOS, StandInWorker, make_scheduler, request, run_to_completion


def test_blocks_are_allocated_one_at_a_time_as_a_sequence_grows():
    scheduler, worker = make_scheduler(block_size=4), StandInWorker()
    scheduler.add(request(prompt_len=5, max_tokens=8))
    step = scheduler.schedule()
    assert len(step.scheduled[0].block_ids) == 2  # 5 prompt tokens in blocks of 4
    held = []
    for _ in range(6):
        scheduler.update(worker.run(step))
        step = scheduler.schedule()
        held.append(len(scheduler.running[0].seqs[0].kv.block_table))
    # tokens computed after each decode: 6, 7, 8, 9, 10, 11 -> blocks 2, 2, 2, 3, 3, 3
    assert held == [2, 2, 2, 3, 3, 3]


def test_decode_steps_send_no_tokens_and_only_new_blocks():
    scheduler, worker = make_scheduler(block_size=4), StandInWorker()
    scheduler.add(request(prompt_len=4, max_tokens=3))
    first = scheduler.schedule()
    assert len(first.new_sequences) == 1 and first.scheduled[0].num_tokens == 4
    scheduler.update(worker.run(first))
    second = scheduler.schedule()
    assert second.new_sequences == []
    entry = second.scheduled[0]
    # The worker appended the token it sampled (104) itself.
    assert (entry.start, entry.num_tokens, entry.appended_token_ids) == (4, 1, [])
    assert worker.tokens[entry.seq_id][-1] == 104
    assert len(entry.block_ids) == 1  # the 5th token opens a second block


def test_new_requests_join_the_running_batch_at_the_next_step():
    scheduler, worker = make_scheduler(), StandInWorker()
    first = request(max_tokens=10)
    scheduler.add(first)
    for _ in range(3):
        scheduler.update(worker.run(scheduler.schedule()))
    late = request(max_tokens=2)
    scheduler.add(late)
    step = scheduler.schedule()
    assert [e.seq_id for e in step.scheduled] == [0, 1]
    kinds = sorted(e.num_tokens for e in step.scheduled)
    assert kinds == [1, 5]  # a decode and a prompt in one flattened step


def test_finished_requests_leave_at_once_and_free_their_blocks():
    scheduler, worker = make_scheduler(), StandInWorker()
    short, long = request(max_tokens=1), request(max_tokens=5)
    scheduler.add(short)
    scheduler.add(long)
    outputs = scheduler.update(worker.run(scheduler.schedule()))
    finished = {o.request_id for o in outputs if o.finished}
    assert finished == {short.request_id}
    assert [r.request_id for r in scheduler.running] == [long.request_id]
    assert scheduler.kv_cache.num_free_blocks == 64 - 2
    next_step = scheduler.schedule()
    assert next_step.finished_seq_ids == [0]  # the worker is told to drop its copy


def test_budgets_limit_how_many_sequences_and_tokens_a_step_takes():
    scheduler = make_scheduler(max_num_seqs=2, max_tokens_per_step=12)
    for _ in range(4):
        scheduler.add(request(prompt_len=5))
    step = scheduler.schedule()
    assert len(step.scheduled) == 2
    scheduler = make_scheduler(max_num_seqs=8, max_tokens_per_step=12)
    for _ in range(4):
        scheduler.add(request(prompt_len=5))
    assert sum(e.num_tokens for e in scheduler.schedule().scheduled) == 10


def test_latest_arrival_is_preempted_by_recompute_when_blocks_run_out():
    scheduler, worker = make_scheduler(num_blocks=6, block_size=4), StandInWorker()
    early, late = request(prompt_len=8, max_tokens=12), request(prompt_len=8, max_tokens=12)
    scheduler.add(early)
    scheduler.add(late)
    outputs = run_to_completion(scheduler, worker)
    assert scheduler.counters.preemptions_recompute >= 1
    assert any(step.preempted_seq_ids == [1] for step in worker.steps)
    recomputed = [s for step in worker.steps for s in step.new_sequences if s.seq_id == 1][-1]
    assert len(recomputed.token_ids) > 8  # prompt plus the tokens generated before preemption
    for req in (early, late):
        tokens = [t for o in outputs[req.request_id] for t in o.sequences[0].token_ids]
        assert tokens == [100 + 8 + i for i in range(12)]
    assert scheduler.kv_cache.num_free_blocks == 6


def test_stop_rules_on_token_ids():
    def eos_at_third(seq_id, position):
        return EOS if position == 7 else 50

    scheduler, worker = make_scheduler(), StandInWorker(eos_at_third)
    stops_at_eos = request(prompt_len=5, max_tokens=10)
    ignores_eos = request(prompt_len=5, max_tokens=4, ignore_eos=True)
    stop_token = request(prompt_len=5, max_tokens=10, stop_token_ids=[50])
    for r in (stops_at_eos, ignores_eos, stop_token):
        scheduler.add(r)
    outputs = run_to_completion(scheduler, worker)

    def result(r):
        deltas = [o.sequences[0] for o in outputs[r.request_id]]
        return [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason

    assert result(stops_at_eos) == ([50, 50, EOS], "stop")
    assert result(ignores_eos) == ([50, 50, EOS, 50], "length")
    assert result(stop_token) == ([50], "stop")


def test_abort_frees_blocks_and_tells_the_worker():
    scheduler, worker = make_scheduler(), StandInWorker()
    r = request(max_tokens=50)
    scheduler.add(r)
    scheduler.update(worker.run(scheduler.schedule()))
    seq = scheduler.running[0].seqs[0]
    assert scheduler.abort(r.request_id).finished
    assert seq.finished and scheduler.kv_cache.num_free_blocks == 64
    scheduler.add(request())
    assert scheduler.schedule().finished_seq_ids == [seq.seq_id]


def test_tokens_sampled_for_an_aborted_sequence_are_ignored():
    scheduler, worker = make_scheduler(), StandInWorker()
    r = request(max_tokens=50)
    scheduler.add(r)
    step = scheduler.schedule()
    scheduler.abort(r.request_id)
    assert scheduler.update(worker.run(step)) == []


def test_requests_that_can_never_run_are_rejected():
    scheduler = make_scheduler(context=16, max_tokens_per_step=64)
    too_long = scheduler.add(request(prompt_len=16))
    assert too_long.finished and "context" in too_long.error
    assert too_long.sequences[0].finish_reason == "rejected"
    assert not scheduler.has_work()
