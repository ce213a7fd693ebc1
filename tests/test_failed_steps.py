"""A step that fails on the worker ends the request that made it fail, and no other.

The worker names the culprit where it can (its adapter would not load, say); otherwise the failed step's requests
run again in halves until one is left. Every other request is computed again, as after a recompute preemption,
and gives the tokens it would have given. Only a worker that fails step after step fails everything.
"""

from __future__ import annotations

from collections import deque

import pytest

from shared.prefix_keys import chain_key
from shared.protocol import StepResult
from tests.scheduler_harness import StandInWorker, check_block_accounting, make_scheduler, request


class FailingWorker(StandInWorker):
    """Fails every step that holds a sequence of a request in `poison`, naming those sequences where `names`; as
    the real worker does, it then forgets every sequence."""

    def __init__(self, scheduler, poison: set[str], names: bool):
        super().__init__()
        self.scheduler, self.poison, self.names = scheduler, poison, names
        self.failures = 0

    def run(self, step):
        sequences = self.scheduler.sequences
        poisoned = [e.seq_id for e in step.scheduled if sequences[e.seq_id].request.request_id in self.poison]
        if not poisoned:
            return super().run(step)
        self.failures += 1
        self.tokens.clear()
        self.tables.clear()
        self.prompts.clear()
        return StepResult(step.step_id, [], 0.0, 0.0, error="boom", culprits=poisoned if self.names else [])


def drive(scheduler, worker, depth: int) -> dict[str, list]:
    """As the scheduler's server runs steps: up to `depth` in flight, and after a failure those planned after the
    failed one are dropped (the worker, which forgot their sequences, refuses them)."""
    outputs: dict[str, list] = {}
    in_flight: deque = deque()
    for _ in range(10_000):
        while len(in_flight) < depth and scheduler.has_work() and not (in_flight and scheduler.needs_drain):
            step = scheduler.schedule()
            if step is None:
                break
            in_flight.append(step)
        if not in_flight:
            break
        result = worker.run(in_flight.popleft())
        if result.error is not None:
            in_flight.clear()
            got = scheduler.recover(result.step_id, result.error, result.culprits)
        else:
            got = scheduler.update(result)
        for output in got:
            outputs.setdefault(output.request_id, []).append(output)
        check_block_accounting(scheduler)
    return outputs


def tokens(outputs: list) -> list[int]:
    return [t for output in outputs for delta in output.sequences for t in delta.token_ids]


def requests(count: int) -> list:
    return [request(prompt_len=5 + i, max_tokens=6 + i % 3) for i in range(count)]


@pytest.mark.parametrize("depth", [1, 2], ids=["after-each-result", "planned-ahead"])
@pytest.mark.parametrize("names", [True, False], ids=["named-by-the-worker", "found-by-halving"])
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_a_step_that_fails_on_one_request_ends_it_alone_and_the_others_give_their_tokens(depth, names, caching):
    batch = requests(6)
    clean = make_scheduler(prefix_caching=caching)
    for message in batch:
        clean.add(message)
    expected = {rid: tokens(out) for rid, out in drive(clean, StandInWorker(), depth).items()}

    scheduler = make_scheduler(prefix_caching=caching)
    for message in batch:
        scheduler.add(message)
    culprit = batch[3].request_id
    worker = FailingWorker(scheduler, {culprit}, names)
    outputs = drive(scheduler, worker, depth)
    assert outputs[culprit][-1].error.startswith("the worker failed on this request: boom")
    for message in batch:
        if message.request_id != culprit:
            assert outputs[message.request_id][-1].finished and outputs[message.request_id][-1].error is None
            assert tokens(outputs[message.request_id]) == expected[message.request_id]
    assert not scheduler.has_work() and not scheduler.requests and not scheduler.queues.held
    assert scheduler.kv_cache.device_pool.num_referenced == 0
    assert worker.failures == 1 if names else worker.failures <= 4  # halving 6 suspects: at most 3 more


def test_two_culprits_are_both_found_and_a_request_arriving_meanwhile_runs():
    scheduler = make_scheduler()
    batch = requests(8)
    for message in batch:
        scheduler.add(message)
    poison = {batch[1].request_id, batch[6].request_id}
    worker = FailingWorker(scheduler, poison, names=False)
    outputs: dict[str, list] = {}
    late = request(prompt_len=4, max_tokens=3)
    for round_ in range(2):
        if round_:
            scheduler.add(late)
        for rid, got in drive(scheduler, worker, 1).items():
            outputs.setdefault(rid, []).extend(got)
    assert {rid for rid, got in outputs.items() if got[-1].error} == poison
    assert all(got[-1].finished for got in outputs.values()) and late.request_id in outputs


def test_a_worker_that_fails_every_step_ends_every_request_saying_so():
    scheduler = make_scheduler()
    batch = requests(4)
    for message in batch:
        scheduler.add(message)
    worker = FailingWorker(scheduler, {m.request_id for m in batch}, names=False)
    outputs = drive(scheduler, worker, 1)
    assert all(got[-1].error for got in outputs.values()) and len(outputs) == 4
    assert not scheduler.requests and scheduler.kv_cache.device_pool.num_referenced == 0


def test_a_block_is_cached_only_once_the_step_that_computes_it_is_done():
    # Planned ahead, the decode after a 7-token prompt computes position 7, the last of block 1, whose token the
    # prompt's result gives: the block is full then, but cached only when the decode's result is in.
    scheduler, worker = make_scheduler(block_size=4, prefix_caching=True), StandInWorker()
    message = request(prompt_len=7, max_tokens=4)
    scheduler.add(message)
    prompt, ahead = scheduler.schedule(), scheduler.schedule()
    seq = next(iter(scheduler.sequences.values()))
    scheduler.update(worker.run(prompt))
    block_1 = chain_key(chain_key(seq.request.cache_root, (1, 2, 3, 4)), (5, 6, 7, 107))
    assert seq.token_ids()[:8] == [1, 2, 3, 4, 5, 6, 7, 107] and not scheduler.kv_cache.holds(block_1)
    scheduler.update(worker.run(ahead))
    assert scheduler.kv_cache.holds(block_1)
