"""Liveness as a property of the policy: every admitted request finishes in a bounded number of
steps, whatever the requests, the aborts and the configuration.

The bound: at every step some admitted, unfinished request is the earliest arrival (the head).
Admission guarantees the head fits the pool alone; every running request arrived before every
waiting or swapped one, so the head is running (scheduled first, never a victim) or nothing
runs and it resumes at once (by recompute if it cannot swap back in). While it is the head it
computes at least one token per step, and it computes at most k * (P + M) tokens (k samples,
P prompt tokens, M max_tokens), plus at most 3 steps to resume. So the run ends within
sum over requests of (3 + k * (P + M)) steps with work pending.

Under the priority and fair policies a request ranks by arrival once it is older than the queue
delay, ahead of every younger one; within at most (last arrival + delay + 1) steps every request
present is that old, the order is FCFS, and the bound above holds from then on.

Planning one step ahead, a step may leave the head out (its pending sample decides what comes
next, or it needs a preemption, which waits until no step is in flight), but the step after it
is planned with that sample known and with the pipeline drained if need be: the head computes
at least one token every two steps, and the bound doubles.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.policy import make_policy
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Budgets, PreemptionPolicy, Scheduler
from services.scheduler.speculation import Speculation
from shared.config import SpeculativeConfig
from shared.protocol import AddRequest, LoraRef
from shared.sampling import SamplingParams
from tests.scheduler_harness import EOS, Pipeline, StandInWorker, check_block_accounting


@st.composite
def configs(draw):
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 64)) if chunked else draw(st.integers(8, 96))
    context = draw(st.integers(4, 96 if chunked else budget))
    return dict(
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        num_blocks=draw(st.integers(4, 48)),
        num_cpu_blocks=draw(st.integers(0, 48)),
        max_num_seqs=draw(st.integers(1, 12)),
        budget=budget,
        context=context,
        chunked=chunked,
        prefix_caching=draw(st.booleans()),
        preemption=draw(st.sampled_from(["swap", "recompute", "auto"])),
        watermark=draw(st.sampled_from([0.0, 0.1])),
        depth=draw(st.sampled_from([1, 2])),  # steps planned ahead of the worker
        max_loras=draw(st.integers(0, 2)),  # 0: no adapters; else adapters' pages share the pool
    )


@st.composite
def requests(draw):
    kind = draw(st.sampled_from(["single", "n", "best_of", "beam"]))
    width = draw(st.integers(1, 4))
    sampling = {
        "single": {},
        "n": {"n": width},
        "best_of": {"n": 1, "best_of": width},
        "beam": {"use_beam_search": True, "best_of": width, "n": min(width, 2)},
    }[kind]
    prefix = draw(st.sampled_from([[], [5, 6, 7, 8, 9, 10, 11, 12]]))
    body = draw(st.lists(st.integers(1, 30), min_size=1, max_size=40))
    return dict(
        prompt=prefix + body,
        sampling=dict(sampling, max_tokens=draw(st.integers(1, 40))),
        arrive_at=draw(st.integers(0, 30)),
        abort_at=draw(st.one_of(st.none(), st.integers(0, 80))),
        priority=draw(st.integers(-3, 3)),
        tenant=draw(st.sampled_from(["", "user:a", "user:b", "tenant-0123456789abcdef"])),
        adapter=draw(st.sampled_from([None, 0, 1, 2])),
    )


# Three adapters of 1 to 3 pages (the stand-in worker computes no LoRA: the scheduler's accounting is what counts).
ADAPTERS = [LoraRef(f"adapter-{i}", "/nowhere", i + 1, ["q_proj"]) for i in range(3)]
ADAPTER_DIMS = {"q_proj": [4, 4]}  # rank r: 8r values a layer, 4 a page half: r pages


QUEUE_DELAY = 6  # steps, on the test's clock


def _build(config, speculative: SpeculativeConfig | None = None, policy: str = "fcfs", clock=None) -> Scheduler:
    manager = KVCacheManager(
        config["num_blocks"],
        config["block_size"],
        config["num_cpu_blocks"],
        config["watermark"],
        config["prefix_caching"],
    )
    budgets = Budgets(config["max_num_seqs"], config["budget"], config["context"], config["chunked"])
    preemption = PreemptionPolicy(
        config["preemption"], block_bytes=1000, swap_bytes_per_second=1e6, prefill_tokens_per_second=1e3
    )
    speculation = Speculation(speculative, config["context"]) if speculative is not None else None
    if config.get("max_loras"):
        manager.enable_adapters(config["max_loras"], 4, ADAPTER_DIMS)
    return Scheduler(
        manager,
        budgets,
        [EOS],
        preemption,
        vocab_size=1000,
        speculation=speculation,
        policy=make_policy(policy, QUEUE_DELAY, {"a": 2.0}),
        **({"clock": clock} if clock else {}),
    )


def _token(seq_id: int, position: int) -> int:
    value = (seq_id * 31 + position * 17) % 23
    return EOS if value == 0 else 100 + value


def _check_fcfs_order(scheduler: Scheduler) -> None:
    """Every running request arrived before every waiting or swapped one."""
    if scheduler.running and (scheduler.waiting or scheduler.swapped):
        latest_running = max(r.order for r in scheduler.running)
        earliest_other = min(r.order for r in [*scheduler.waiting, *scheduler.swapped])
        assert latest_running < earliest_other


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), specs=st.lists(requests(), min_size=1, max_size=10))
def test_every_admitted_request_finishes_within_the_bound(policy, config, specs):
    now = [0.0]
    scheduler, worker = _build(config, policy=policy, clock=lambda: now[0]), StandInWorker(_token)
    pipeline = Pipeline(scheduler, worker, config["depth"])
    admitted: dict[str, dict] = {}
    finished: set[str] = set()
    bound, busy_steps, step_index = 0, 0, 0
    last_arrival = max(spec["arrive_at"] for spec in specs)
    aging = 0 if policy == "fcfs" else last_arrival + QUEUE_DELAY + 2
    while step_index <= last_arrival or scheduler.has_work():
        now[0] = float(step_index)
        for i, spec in enumerate(specs):
            if spec["arrive_at"] == step_index:
                request_id = f"r{i}"
                params = SamplingParams(temperature=0.0, **spec["sampling"])
                priority = spec["priority"] if policy == "priority" else 0
                adapter = spec["adapter"]
                lora = ADAPTERS[adapter] if adapter is not None and config.get("max_loras") else None
                rejected = scheduler.add(
                    AddRequest(
                        request_id,
                        spec["prompt"],
                        params,
                        float(step_index),
                        priority=priority,
                        tenant=spec["tenant"],
                        lora=lora,
                    )
                )
                if rejected is None:
                    admitted[request_id] = spec
                    max_new = min(params.max_tokens, config["context"] - len(spec["prompt"]))
                    bound += 3 + params.num_samples * (len(spec["prompt"]) + max(max_new, 0))
                else:
                    assert rejected.finished and rejected.sequences[0].finish_reason == "rejected"
            if spec["abort_at"] == step_index and f"r{i}" in scheduler.requests:
                output = scheduler.abort(f"r{i}")
                assert output.finished
                finished.add(f"r{i}")
        if scheduler.has_work() or pipeline.in_flight:
            busy_steps += 1
            pipeline.fill()
            assert pipeline.in_flight, "schedule() returned nothing while requests are pending"
            for output in pipeline.advance():
                if output.finished:
                    assert output.error is None, output.error
                    finished.add(output.request_id)
            check_block_accounting(scheduler)
            if policy == "fcfs":
                _check_fcfs_order(scheduler)
            assert sum(len(r.seqs) for r in scheduler.running) <= config["max_num_seqs"]
            assert busy_steps <= aging + config["depth"] * bound, (
                f"still running after {busy_steps} steps; the bound is {bound}"
            )
        step_index += 1
    assert set(admitted) <= finished
    manager = scheduler.kv_cache
    assert manager.device_pool.num_referenced == 0 and manager.swap_pool.num_referenced == 0
    assert all(r.status is RequestStatus.FINISHED for r in scheduler.requests.values())
