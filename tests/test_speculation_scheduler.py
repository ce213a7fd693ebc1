"""Speculation in the scheduler, driven without a model: proposals ride in a step after a decode's
last token, take blocks only where blocks are free, and the positions and blocks of rejected
proposals go back before anything is hashed, copied or swapped.

The stand-in worker "samples" a fixed function of the position, so the tokens each request must
get are known, and verifies proposals as the real worker does: it keeps them while they equal
what it samples.
"""

from __future__ import annotations

import contextlib
import threading

import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.server import SchedulerServer
from shared import sockets
from shared.config import Endpoints, SchedulerConfig, SpeculativeConfig
from shared.prefix_keys import ROOT, chain_key
from shared.protocol import AddRequest, Ready
from shared.sampling import SamplingParams
from tests.conftest import wait_until
from tests.scheduler_harness import StandInWorker, check_block_accounting, make_scheduler, request, run_to_completion
from tests.test_liveness import _build, configs

NGRAM = SpeculativeConfig("ngram", 4, 1, 3, adaptive=False)


def cycle(length: int):
    """Tokens that repeat every `length` positions: once seen, every n-gram proposal is right."""
    return lambda seq_id, position: 100 + position % length


def drifting(seq_id: int, position: int) -> int:
    """Mostly a cycle of 7, with a surprise every 11th position: proposals are accepted in part."""
    return 999 if position % 11 == 0 else 100 + position % 7


def tokens_of(outputs: dict, request_id: str, index: int = 0) -> list[int]:
    return [t for o in outputs[request_id] for d in o.sequences if d.index == index for t in d.token_ids]


def test_a_decode_step_asks_the_worker_for_proposals_and_holds_the_slots_for_them():
    scheduler, worker = make_scheduler(block_size=4, speculative=NGRAM), StandInWorker(cycle(3))
    scheduler.add(request(prompt_len=6, max_tokens=20))  # prompt 1..6, then 100 + position % 3
    for _ in range(4):
        scheduler.update(worker.run(scheduler.schedule()))
    step = scheduler.schedule()
    entry = step.scheduled[0]
    assert entry.num_draft_tokens == 4 and entry.num_tokens == 1 + 4 and not entry.start_at_end
    seq = scheduler.sequences[entry.seq_id]
    assert entry.start == seq.num_tokens - 1  # after the last token, whose keys come first
    assert len(seq.kv.block_table) * 4 >= entry.start + entry.num_tokens  # a slot for every proposal
    assert not scheduler.needs_drain  # the worker makes the proposals: the next step is planned at once


def test_a_step_planned_behind_a_speculating_one_starts_where_the_worker_says():
    # Proposals are right up to position 12, which breaks the cycle: the step ahead keeps fewer than it verified.
    worker = StandInWorker(lambda seq_id, position: 999 if position == 12 else 100 + position % 3, block_size=4)
    scheduler = make_scheduler(block_size=4, speculative=NGRAM)
    req = request(prompt_len=6, max_tokens=30)
    scheduler.add(req)
    outputs = run_to_completion(scheduler, worker, depth=2)
    behind = [e for step in worker.steps for e in step.scheduled if e.start_at_end]
    assert behind and any(e.num_draft_tokens for e in behind)  # speculating steps were planned ahead
    stats = scheduler.speculation.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # some proposals were rejected
    want = [999 if p == 12 else 100 + p % 3 for p in range(6, 36)]
    assert tokens_of(outputs, req.request_id) == want
    assert not scheduler.has_work() and scheduler.kv_cache.device_pool.num_referenced == 0


def test_rejected_proposals_give_back_their_positions_and_blocks():
    # The proposal [100, 101, 102, 100] is right about its first token only: position 12 breaks the cycle.
    worker = StandInWorker(lambda seq_id, position: 999 if position == 12 else 100 + position % 4)
    scheduler = make_scheduler(block_size=4, speculative=SpeculativeConfig("ngram", 4, 1, 1, adaptive=False))
    scheduler.add(request(prompt_len=6, max_tokens=20))
    while not worker.verified or worker.verified[-1][1] == 0:
        scheduler.update(worker.run(scheduler.schedule()))
        check_block_accounting(scheduler)
    seq = next(iter(scheduler.sequences.values()))
    assert seq.num_speculative == 0 and seq.kv.num_computed == seq.num_tokens - 1
    assert len(seq.kv.block_table) == -(-seq.kv.num_computed // 4)  # none held for rejected positions
    stats = scheduler.speculation.stats
    assert stats.num_drafts == 1 and stats.num_draft_tokens == 4 and stats.num_accepted_tokens == 1


def test_a_stop_token_inside_an_accepted_run_ends_the_sequence_there():
    stop_at = 14  # the token at position 14 is a stop id, in the middle of a run of accepted proposals
    worker = StandInWorker(lambda seq_id, position: 7 if position == stop_at else 100 + position % 3)
    scheduler = make_scheduler(block_size=4, speculative=NGRAM)
    req = request(prompt_len=6, max_tokens=40, stop_token_ids=[7])
    scheduler.add(req)
    outputs = run_to_completion(scheduler, worker)
    tokens = tokens_of(outputs, req.request_id)
    assert tokens[-1] == 7 and len(tokens) == stop_at - 6 + 1  # nothing after the stop token
    assert outputs[req.request_id][-1].sequences[0].finish_reason == "stop"
    assert any(proposals > 1 for _, proposals in worker.verified)
    assert not scheduler.has_work() and scheduler.kv_cache.device_pool.num_referenced == 0


def test_proposals_never_run_past_max_tokens_or_the_context():
    scheduler = make_scheduler(block_size=4, context=24, max_tokens_per_step=24, speculative=NGRAM)
    worker = StandInWorker(cycle(2))
    short, long = request(prompt_len=6, max_tokens=9), request(prompt_len=6, max_tokens=18)
    scheduler.add(short)
    scheduler.add(long)
    outputs = run_to_completion(scheduler, worker)
    assert len(tokens_of(outputs, short.request_id)) == 9
    assert len(tokens_of(outputs, long.request_id)) == 18  # 6 + 18 = the context of 24
    for step in worker.steps:
        for entry in step.scheduled:
            assert entry.start + entry.num_tokens <= 23  # the last token of a full context is never computed
    for request_id in (short.request_id, long.request_id):
        assert outputs[request_id][-1].sequences[0].finish_reason == "length"


def test_proposals_take_only_free_blocks_and_never_preempt_anyone():
    # Two requests fill all 8 blocks but one; a proposal that needs a block more is dropped.
    scheduler = make_scheduler(num_blocks=8, block_size=4, speculative=NGRAM)
    worker = StandInWorker(cycle(2))
    for _ in range(2):
        scheduler.add(request(prompt_len=12, max_tokens=4))
    outputs = run_to_completion(scheduler, worker)
    assert scheduler.counters.preemptions_recompute == scheduler.counters.preemptions_swap == 0
    assert all(len(tokens_of(outputs, r)) == 4 for r in outputs)


def test_beam_search_never_speculates():
    scheduler = make_scheduler(block_size=4, speculative=NGRAM)
    worker = StandInWorker(cycle(2))
    scheduler.add(request(prompt_len=6, max_tokens=8, use_beam_search=True, best_of=2))
    run_to_completion(scheduler, worker)
    assert all(not e.num_draft_tokens for step in worker.steps for e in step.scheduled)


def test_a_draft_model_is_asked_for_its_drafts_by_count():
    draft = SpeculativeConfig("draft_model", 3, model="draft", adaptive=False)
    scheduler = make_scheduler(block_size=4, speculative=draft)
    worker = StandInWorker(cycle(5), draft_token=lambda seq_id, position: 100 + position % 5)
    req = request(prompt_len=6, max_tokens=13)
    scheduler.add(req)
    outputs = run_to_completion(scheduler, worker)
    decodes = [e for step in worker.steps for e in step.scheduled if e.start >= 6]
    assert all(e.num_draft_tokens for e in decodes)
    assert len(worker.steps) == 1 + 3  # the prompt, then 4 tokens a step: 1 + 4 + 4 + 4 = 13
    assert tokens_of(outputs, req.request_id) == [100 + p % 5 for p in range(6, 19)]


def _cache_keys_of_true_tokens(outputs, prompts, block_size) -> set[bytes]:
    keys = set()
    for request_id, prompt in prompts.items():
        for index in {d.index for o in outputs[request_id] for d in o.sequences}:
            tokens = prompt + tokens_of(outputs, request_id, index)
            parent = ROOT
            for start in range(0, len(tokens) - block_size + 1, block_size):
                parent = chain_key(parent, tokens[start : start + block_size])
                keys.add(parent)
    return keys


@st.composite
def requests(draw):
    kind = draw(
        st.sampled_from(
            [
                {},
                {},
                {"n": 2},
                {"n": 1, "best_of": 2},
                {"stop_token_ids": [999]},
                {"use_beam_search": True, "best_of": 2},
            ]
        )
    )
    prompt = [5, 6, 7, 8] * draw(st.integers(0, 3)) + draw(st.lists(st.integers(1, 30), min_size=1, max_size=20))
    return prompt, dict(kind, max_tokens=draw(st.integers(1, 40)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs(),
    specs=st.lists(requests(), min_size=1, max_size=6),
    depth=st.sampled_from([1, 2]),
    k=st.integers(1, 5),
)
def test_speculation_gives_the_tokens_of_plain_decoding_and_keeps_the_invariants(config, specs, depth, k):
    results = []
    for speculative in (None, SpeculativeConfig("ngram", k, 1, 3, adaptive=False)):
        scheduler = _build(config, speculative)
        prompts = {}
        for i, (prompt, sampling) in enumerate(specs):
            request = AddRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, **sampling), float(i))
            if scheduler.add(request) is None:
                prompts[f"r{i}"] = prompt
        worker = StandInWorker(drifting, block_size=scheduler.kv_cache.block_size)
        outputs = run_to_completion(scheduler, worker, depth=depth)
        assert not scheduler.has_work() and scheduler.kv_cache.device_pool.num_referenced == 0
        check_block_accounting(scheduler)
        beams = any(sampling.get("use_beam_search") for _, sampling in specs)  # pruned beams hash blocks too
        if scheduler.kv_cache.device_pool.enable_caching and not beams:  # no rejected token was ever hashed
            cached = set(scheduler.kv_cache.device_pool._by_hash)
            assert cached <= _cache_keys_of_true_tokens(outputs, prompts, scheduler.kv_cache.block_size)
        results.append(
            {
                (r, d.index): [t for o in outputs[r] for dd in o.sequences if dd.index == d.index for t in dd.token_ids]
                for r in outputs
                for o in outputs[r]
                for d in o.sequences
            }
        )
    assert results[0] == results[1]


def test_checking_blocks_after_every_step_of_a_speculating_batch_under_preemption():
    for preemption in ("swap", "recompute"):
        scheduler = make_scheduler(
            num_blocks=14, block_size=4, num_cpu_blocks=32, preemption=preemption, speculative=NGRAM
        )
        worker = StandInWorker(drifting, block_size=scheduler.kv_cache.block_size)
        for i in range(4):
            scheduler.add(request(prompt_len=6 + i, max_tokens=24))
        steps = 0
        while scheduler.has_work():
            step = scheduler.schedule()
            if step is None:
                break
            scheduler.update(worker.run(step))
            check_block_accounting(scheduler)
            steps += 1
        preempted = getattr(scheduler.counters, f"preemptions_{preemption}")
        assert preempted > 0, "the pool was meant to be too small for all four"
        assert any(n for _, n in worker.verified) and scheduler.speculation.stats.num_accepted_tokens > 0
        assert not scheduler.has_work() and scheduler.kv_cache.device_pool.num_referenced == 0


def test_no_proposals_while_more_sequences_decode_than_disable_by_batch_size():
    speculative = SpeculativeConfig("ngram", 4, 1, 3, adaptive=False, disable_by_batch_size=2)
    scheduler, worker = make_scheduler(block_size=4, speculative=speculative), StandInWorker(cycle(3))
    for max_tokens in (8, 20, 32):  # three decode at first, then two, then one
        scheduler.add(request(prompt_len=6, max_tokens=max_tokens))
    run_to_completion(scheduler, worker)
    steps = [[e for e in step.scheduled if e.start >= 6] for step in worker.steps]
    assert all(not e.num_draft_tokens for decodes in steps if len(decodes) > 2 for e in decodes)
    assert any(e.num_draft_tokens for decodes in steps if len(decodes) <= 2 for e in decodes)


@contextlib.contextmanager
def speculating_scheduler_told_ready(tmp_path, drafts: str):
    """A speculating scheduler's loop in a thread, and a rank that reports Ready drafting `drafts`."""
    endpoints = Endpoints.local(str(tmp_path))
    server = SchedulerServer(SchedulerConfig(block_size=4, speculative=NGRAM), endpoints)
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    context = zmq.Context()
    worker = sockets.connect(context, zmq.DEALER, endpoints.workers, identity=b"worker-0")
    try:
        sockets.send(worker, Ready(0, 1, 64, 0, 4, 128, [0], 1024, 1e9, 1e4, drafts=drafts))
        yield server, loop
    finally:
        if loop.is_alive():
            server.stop()
            loop.join(timeout=5)
        context.destroy(linger=0)


def test_a_scheduler_that_speculates_refuses_workers_that_do_not_make_its_proposals(tmp_path):
    """The worker makes the proposals: a rank started without the same --speculative-config would
    be asked for drafts it cannot make, so the scheduler stops at once and says why."""
    with speculating_scheduler_told_ready(tmp_path, drafts="") as (server, loop):
        loop.join(timeout=10)
        assert not loop.is_alive() and server.exit_code == 2


def test_a_scheduler_that_speculates_starts_with_workers_that_make_its_proposals(tmp_path):
    with speculating_scheduler_told_ready(tmp_path, drafts="ngram") as (server, _):
        assert wait_until(lambda: server.scheduler is not None, timeout=10)
        assert server.running


def test_no_proposals_for_the_step_that_forks_a_prompt_into_n_samples():
    # Chunked prefill leaves one prompt token for the second step, which samples n = 2 at once.
    scheduler = make_scheduler(block_size=4, chunked=True, max_tokens_per_step=8, speculative=NGRAM)
    worker = StandInWorker(cycle(3), block_size=4)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7]
    scheduler.add(AddRequest("forks", prompt, SamplingParams(temperature=0.0, max_tokens=6, n=2), 0.0))
    outputs = run_to_completion(scheduler, worker, depth=2)
    last_prompt_token = worker.steps[1].scheduled[0]
    assert (last_prompt_token.start, last_prompt_token.num_tokens) == (8, 1)
    assert last_prompt_token.num_draft_tokens == 0
    assert {i: len(tokens_of(outputs, "forks", i)) for i in (0, 1)} == {0: 6, 1: 6}
    assert not scheduler.has_work() and scheduler.kv_cache.device_pool.num_referenced == 0
