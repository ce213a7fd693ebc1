"""Scheduling policies, one promise each: priority admits and preempts by priority, fair shares
service between tenants by their weights, old requests age past every policy, and nothing a
policy allows is refused under FCFS without a clear reason."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.api.errors import ApiError
from services.api.requests import parse_chat, parse_completion
from services.scheduler.policy import (
    MAX_TENANT_LABELS,
    USER_LABEL_CHARS,
    FairPolicy,
    PriorityPolicy,
    SchedulingPolicy,
    TenantLabels,
    make_policy,
)
from services.scheduler.request import RequestStatus
from tests.conftest import metric_total, serve, wait_until, wait_until_async
from tests.scheduler_harness import StandInWorker, check_block_accounting, make_scheduler, request

TENANT_A, TENANT_B = "tenant-aaaaaaaaaaaaaaaa", "tenant-bbbbbbbbbbbbbbbb"


def _step(scheduler, worker):
    step = scheduler.schedule()
    assert step is not None
    outputs = scheduler.update(worker.run(step))
    check_block_accounting(scheduler)
    return outputs


def _run_to_end(scheduler, worker) -> list[str]:
    """Request ids in the order they finished."""
    finished = []
    while scheduler.has_work():
        finished += [o.request_id for o in _step(scheduler, worker) if o.finished]
    return finished


def test_a_high_priority_request_overtakes_a_queue_of_low_priority_ones():
    scheduler, worker = make_scheduler(max_num_seqs=1, policy=PriorityPolicy()), StandInWorker()
    low = [request(prompt_len=4, max_tokens=3, priority=5) for _ in range(4)]
    for message in low:
        scheduler.add(message)
    _step(scheduler, worker)  # the first low-priority request runs
    high = request(prompt_len=4, max_tokens=3, priority=-1)
    scheduler.add(high)
    finished = _run_to_end(scheduler, worker)
    # It ran next: the running one gave its seat up to it, and the queue behind waited.
    assert finished[0] == high.request_id
    assert finished[1:] == [m.request_id for m in low]
    assert scheduler.counters.preemptions_recompute == 1


def test_under_fcfs_the_same_arrivals_finish_in_arrival_order():
    scheduler, worker = make_scheduler(max_num_seqs=1), StandInWorker()
    messages = [request(prompt_len=4, max_tokens=3) for _ in range(4)]
    for message in messages:
        scheduler.add(message)
    assert _run_to_end(scheduler, worker) == [m.request_id for m in messages]
    assert scheduler.counters.preemptions_recompute == 0


def test_a_memory_shortage_preempts_the_lowest_priority_first_not_the_latest_arrival():
    # Three requests fit at start (2 blocks each of 6); as they grow the pool runs short.
    scheduler, worker = (
        make_scheduler(num_blocks=6, block_size=4, max_num_seqs=3, policy=PriorityPolicy()),
        StandInWorker(),
    )
    lowest = request(prompt_len=7, max_tokens=12, priority=9)  # arrives first
    middle = request(prompt_len=7, max_tokens=12, priority=1)
    highest = request(prompt_len=7, max_tokens=12, priority=-3)
    for message in (lowest, middle, highest):
        scheduler.add(message)
    victims = []
    while scheduler.has_work() and not victims:
        before = {r.request_id for r in scheduler.running}
        _step(scheduler, worker)
        victims = [rid for rid in before if scheduler.requests[rid].status is RequestStatus.WAITING]
    assert victims == [lowest.request_id]
    assert _run_to_end(scheduler, worker)[0] == highest.request_id


def test_a_request_older_than_the_queue_delay_goes_ahead_of_any_priority():
    now = [0.0]
    scheduler, worker = (
        make_scheduler(max_num_seqs=1, policy=PriorityPolicy(max_queue_delay=10.0), clock=lambda: now[0]),
        StandInWorker(),
    )
    holder = request(prompt_len=4, max_tokens=30, priority=-5)  # holds the one seat meanwhile
    old_low = request(prompt_len=4, max_tokens=2, priority=100)
    scheduler.add(holder)
    scheduler.add(old_low)
    _step(scheduler, worker)
    now[0] = 11.0
    fresh_high = request(prompt_len=4, max_tokens=2, priority=-100)
    scheduler.add(fresh_high)
    # Both old requests now rank by arrival, ahead of any priority.
    assert _run_to_end(scheduler, worker) == [holder.request_id, old_low.request_id, fresh_high.request_id]


def _served(scheduler, tenant: str) -> int:
    prompt, output = scheduler.counters.served.get((tenant, "default"), [0, 0])
    return prompt + 2 * output


def _flood_and_trickle(policy: SchedulingPolicy, steps: int = 60, b_outstanding: int = 2):
    """Tenant A queues 40 requests at once; tenant B keeps `b_outstanding` in the system, sending the
    next as one finishes. Returns the scheduler after `steps` steps."""
    scheduler, worker = make_scheduler(num_blocks=256, max_num_seqs=4, policy=policy), StandInWorker()
    for _ in range(40):
        scheduler.add(request(prompt_len=8, max_tokens=16, tenant=TENANT_A))
    b_in_system = set()
    for _ in range(steps):
        while len(b_in_system) < b_outstanding:
            message = request(prompt_len=8, max_tokens=16, tenant=TENANT_B)
            scheduler.add(message)
            b_in_system.add(message.request_id)
        for output in _step(scheduler, worker):
            if output.finished:
                b_in_system.discard(output.request_id)
    return scheduler


def test_under_fair_a_flooding_tenant_takes_no_more_than_its_share_from_a_steady_one():
    fair = _flood_and_trickle(FairPolicy())
    a, b = _served(fair, TENANT_A), _served(fair, TENANT_B)
    # B has two requests in the system and four seats are shared: it gets about half.
    assert b >= 0.4 * (a + b), (a, b)
    fcfs = _flood_and_trickle(SchedulingPolicy())
    assert _served(fcfs, TENANT_B) < 0.1 * _served(fcfs, TENANT_A)  # behind all 40 of A's


def test_under_fair_a_tenant_with_nothing_running_takes_a_seat_from_a_flood_at_once():
    scheduler, worker = make_scheduler(max_num_seqs=2, policy=FairPolicy()), StandInWorker()
    flood = [request(prompt_len=4, max_tokens=40, tenant=TENANT_A) for _ in range(6)]
    for message in flood:
        scheduler.add(message)
    for _ in range(3):
        _step(scheduler, worker)
    first, second = request(prompt_len=4, max_tokens=40, tenant=TENANT_B), request(prompt_len=4, tenant=TENANT_B)
    scheduler.add(first)
    scheduler.add(second)
    _step(scheduler, worker)
    running = {r.request_id for r in scheduler.running}
    # B's first request took the seat of A's latest; its second waits for a seat like anyone's.
    assert running == {flood[0].request_id, first.request_id}
    assert scheduler.requests[flood[1].request_id].status is RequestStatus.WAITING
    assert scheduler.counters.preemptions_recompute == 1


def test_under_fair_weights_scale_a_tenants_share():
    # Both backlogged, B with as many requests as there are seats: A's weight of 3 gets it about 3/4.
    weighted = _flood_and_trickle(FairPolicy(weights={TENANT_A: 3.0}), steps=80, b_outstanding=4)
    a, b = _served(weighted, TENANT_A), _served(weighted, TENANT_B)
    assert 2.0 * b < a < 4.0 * b, (a, b)
    even = _flood_and_trickle(FairPolicy(), steps=80, b_outstanding=4)
    a, b = _served(even, TENANT_A), _served(even, TENANT_B)
    assert 0.6 * b < a < 1.6 * b, (a, b)


def _prompt_tokens_of_next_step(scheduler, worker) -> int:
    before = scheduler.counters.prompt_tokens_computed
    _step(scheduler, worker)
    return scheduler.counters.prompt_tokens_computed - before


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
def test_under_fair_a_step_carries_half_its_budget_of_prompts_while_another_tenant_is_active(chunked):
    """A request that arrives while a step computes waits for it: while more than one tenant is active, one
    tenant's prompts fill half a step, so the step a newcomer waits for is short; alone, the whole budget."""
    now = [0.0]
    scheduler = make_scheduler(
        num_blocks=256,
        max_num_seqs=16,
        max_tokens_per_step=64,
        chunked=chunked,
        policy=FairPolicy(),
        clock=lambda: now[0],
    )
    worker = StandInWorker()
    for _ in range(12):
        scheduler.add(request(prompt_len=16, max_tokens=40, tenant=TENANT_A))
    assert _prompt_tokens_of_next_step(scheduler, worker) == 64  # A alone: four prompts
    steady = request(prompt_len=4, max_tokens=1, tenant=TENANT_B)
    scheduler.add(steady)
    _step(scheduler, worker)  # B's request runs alone with A's decodes, and ends
    assert steady.request_id not in scheduler.requests
    now[0] += 1.0  # B has no request present, but had one a moment ago: it may send its next any time
    assert _prompt_tokens_of_next_step(scheduler, worker) == 32
    now[0] += 2.0  # B is gone
    decoding = len(scheduler.running)
    assert 32 < _prompt_tokens_of_next_step(scheduler, worker) <= 64 - decoding  # the budget, less A's decodes


def test_under_fair_a_prompt_longer_than_the_cap_still_starts_where_prompts_are_not_split():
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=16, max_tokens_per_step=64, policy=FairPolicy())
    worker = StandInWorker()
    scheduler.add(request(prompt_len=4, max_tokens=40, tenant=TENANT_B))
    long = request(prompt_len=48, max_tokens=4, tenant=TENANT_A)
    scheduler.add(long)
    _step(scheduler, worker)  # B's request: A's, of more than half the budget, is not in its step
    assert _prompt_tokens_of_next_step(scheduler, worker) == 48  # the step's first prompt goes past the cap
    assert scheduler.requests[long.request_id].status is RequestStatus.RUNNING


def test_an_idle_tenant_banks_no_credit():
    policy = FairPolicy()
    scheduler = make_scheduler(policy=policy)
    first = request(tenant=TENANT_A)
    scheduler.add(first)
    policy.served(scheduler.requests[first.request_id], 0, 1000)
    assert policy.counters[TENANT_A] == 2000
    scheduler.add(request(tenant=TENANT_B))
    assert policy.counters[TENANT_B] == 2000  # starts level with the least served present, not at 0
    scheduler.abort(first.request_id)
    assert TENANT_A not in policy.counters  # gone with its last request


def test_every_policy_counts_served_tokens_and_queue_time_under_bounded_labels():
    labels = TenantLabels()
    assert [labels(t) for t in ("", "user:alice", "user:bob", TENANT_A, "tenant-xyz")] == [
        "none",
        "user:alice",
        "user:bob",
        TENANT_A,
        "other",
    ]
    assert labels("user:" + "x" * 1000) == "user:" + "x" * USER_LABEL_CHARS
    many = [labels(f"user:u{i}") for i in range(2 * MAX_TENANT_LABELS)]
    assert len(set(many)) == MAX_TENANT_LABELS - 3 + 1 and many[-1] == "user:other"  # alice, bob and the long one
    assert labels("user:alice") == "user:alice" and labels(TENANT_B) == TENANT_B
    for name in ("fcfs", "priority", "fair"):
        scheduler, worker = make_scheduler(policy=make_policy(name, 60.0)), StandInWorker()
        scheduler.add(
            request(prompt_len=6, max_tokens=3, tenant="user:carol", priority=-2 if name == "priority" else 0)
        )
        _run_to_end(scheduler, worker)
        priority = "high" if name == "priority" else "default"
        assert scheduler.counters.served == {("user:carol", priority): [6, 3]}
        assert [(tenant, cls) for _, tenant, cls in scheduler.queue_times] == [("user:carol", priority)]


def test_priority_is_refused_where_the_policy_does_not_use_it_and_out_of_range_everywhere():
    fcfs = make_scheduler()
    refused = fcfs.add(request(priority=3))
    assert refused is not None and "--scheduling-policy priority" in refused.error
    by_priority = make_scheduler(policy=PriorityPolicy())
    assert by_priority.add(request(priority=-(2**31))) is None
    refused = by_priority.add(request(priority=2**31))
    assert refused is not None and "priority must be in" in refused.error
    refused = by_priority.add(request(tenant="user:" + "x" * 400))
    assert refused is not None and "tenant" in refused.error


def _steps_until_low_priority_finishes(max_queue_delay: float, limit: int = 200) -> int | None:
    """A low-priority request under a stream of high-priority ones that never lets up."""
    now = [0.0]
    scheduler, worker = (
        make_scheduler(max_num_seqs=1, policy=PriorityPolicy(max_queue_delay), clock=lambda: now[0]),
        StandInWorker(),
    )
    low = request(prompt_len=4, max_tokens=4, priority=1)
    scheduler.add(low)
    for step in range(limit):
        now[0] = float(step)
        scheduler.add(request(prompt_len=4, max_tokens=2, priority=-1))
        if any(o.finished and o.request_id == low.request_id for o in _step(scheduler, worker)):
            return step
    return None


def test_no_request_starves_behind_a_stream_of_higher_priority_ones():
    assert _steps_until_low_priority_finishes(float("inf")) is None  # what the queue delay is for
    finished_at = _steps_until_low_priority_finishes(20.0)
    assert finished_at is not None and finished_at <= 20 + 8


@pytest.mark.parametrize("value", [True, "1", 1.5, 2**31, -(2**31) - 1])
@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_a_bad_priority_is_a_400_naming_the_field(parse, value):
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "priority": value}
    with pytest.raises(ApiError) as raised:
        parse(body)
    assert raised.value.status == 400 and raised.value.param == "priority"


def test_a_priority_and_a_user_are_read_from_the_body():
    parsed = parse_chat({"messages": [{"role": "user", "content": "x"}], "priority": -7, "user": "alice"})
    assert (parsed.priority, parsed.user) == (-7, "alice")
    with pytest.raises(ApiError):
        parse_completion({"prompt": "x", "user": "u" * 257})


@pytest.mark.slow
def test_a_priority_server_runs_the_urgent_request_first_and_labels_its_metrics(llama_dir, tmp_path):
    with serve(
        llama_dir, str(tmp_path), "--scheduling-policy", "priority", "--max-num-seqs", "1", "--no-async-scheduling"
    ) as server:
        finished: list[str] = []

        async def send(client: httpx.AsyncClient, name: str, priority: int, max_tokens: int) -> None:
            response = await client.post(
                "/v1/completions",
                json={
                    "model": server.model,
                    "prompt": "The cat",
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "priority": priority,
                    "user": name,
                },
            )
            assert response.status_code == 200, response.text
            finished.append(name)

        async def until(predicate) -> None:
            assert await wait_until_async(lambda: predicate(server.metrics("scheduler")), 60)

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
                first = asyncio.create_task(send(client, "first", 5, 400))
                await until(lambda m: m["pagedserve_num_requests_running"] == 1)  # it holds the one seat
                queued = [asyncio.create_task(send(client, f"low{i}", 5, 8)) for i in range(3)]
                await until(lambda m: m["pagedserve_num_requests_waiting"] == 3)
                urgent = asyncio.create_task(send(client, "urgent", -5, 8))
                await asyncio.gather(first, *queued, urgent)

        asyncio.run(scenario())
        assert finished.index("urgent") < min(finished.index(f"low{i}") for i in range(3))
        assert finished.index("urgent") < finished.index("first")  # it took the running one's seat
        out_of_range = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": server.model, "prompt": "x", "max_tokens": 1, "priority": 2**40},
        )
        assert out_of_range.status_code == 400 and out_of_range.json()["error"]["param"] == "priority"
        metrics = server.metrics("scheduler")
        assert metric_total(metrics, "pagedserve_request_queue_time_seconds_count") >= 5
        assert metrics['pagedserve_request_queue_time_seconds_count{priority="high",tenant="user:urgent"}'] == 1
        assert metrics['pagedserve_served_tokens_total{kind="output",priority="high",tenant="user:urgent"}'] == 8
        assert wait_until(server.is_idle, 5)


@pytest.mark.slow
def test_a_priority_sent_to_a_server_that_schedules_by_arrival_is_a_400(llama_server):
    response = httpx.post(
        f"{llama_server.base_url}/v1/chat/completions",
        timeout=60,
        json={
            "model": llama_server.model,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
            "priority": 3,
        },
    )
    assert response.status_code == 400 and "--scheduling-policy priority" in response.json()["error"]["message"]


def test_a_step_of_mostly_prompts_waits_for_the_one_computing_under_a_policy_that_reorders():
    for policy, plans_ahead in ((SchedulingPolicy(), True), (PriorityPolicy(), False), (FairPolicy(), False)):
        scheduler = make_scheduler(max_tokens_per_step=32, chunked=True, policy=policy)
        scheduler.add(request(prompt_len=100, max_tokens=4))
        assert scheduler.schedule() is not None  # the first chunk; 68 prompt tokens are left
        ahead = scheduler.schedule()
        assert (ahead is not None) is plans_ahead and scheduler.needs_drain is not plans_ahead
