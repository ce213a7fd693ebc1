"""Each service's /metrics tells the truth after a burst: block gauges back at their idle values,
preemption counters equal to the preemptions the scheduler logged, cached tokens within prompt
tokens, and the phases the scheduler and the worker time count the same steps."""

from __future__ import annotations

import re

import pytest

from tests.conftest import serve, wait_until
from tests.test_prometheus import SMALL_KV, load

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


@pytest.fixture(scope="module")
def burst_server(llama_dir, tmp_path_factory):
    with serve(llama_dir, str(tmp_path_factory.mktemp("metrics")), *SMALL_KV, "--preemption-mode", "auto") as server:
        load(server, 12)
        load(server, 2)  # the shared prefix is cached by now
        assert wait_until(server.is_idle, 10)
        yield server


def test_block_gauges_return_to_idle_after_a_burst_with_preemptions(burst_server):
    metrics = burst_server.metrics("scheduler")
    device = {
        state: metrics[f'pagedserve_kv_blocks{{device="cpu",pool="device",state="{state}"}}']
        for state in ("used", "cached", "free")
    }
    assert device["used"] == 0 and device["cached"] > 0  # the prefix stays cached, evictable
    assert (
        device["cached"] + device["free"] == metrics['pagedserve_kv_blocks_capacity{device="cpu",pool="device"}'] == 40
    )
    swap = metrics['pagedserve_kv_blocks{device="cpu",pool="swap",state="free"}']
    assert swap == metrics['pagedserve_kv_blocks_capacity{device="cpu",pool="swap"}'] > 0
    assert metrics['pagedserve_kv_usage_ratio{device="cpu",pool="device"}'] == 0
    assert metrics["pagedserve_num_requests_waiting"] == metrics["pagedserve_num_requests_swapped"] == 0


def test_preemption_counters_equal_the_preemptions_the_scheduler_logged(burst_server):
    metrics = burst_server.metrics("scheduler")
    log = burst_server.log()
    logged = {
        "swap": len(re.findall(r"preempting \S+ by swapping", log)),
        "recompute": len(re.findall(r"preempting \S+ by recompute", log)),
    }
    assert sum(logged.values()) > 0
    for mode, count in logged.items():
        assert metrics[f'pagedserve_preemptions_total{{mode="{mode}"}}'] == count
    if logged["swap"]:
        assert metrics['pagedserve_blocks_swapped_total{direction="out"}'] > 0
        assert metrics['pagedserve_blocks_swapped_total{direction="in"}'] > 0


def test_cached_prompt_tokens_never_exceed_the_prompt_tokens_looked_up(burst_server):
    metrics = burst_server.metrics()
    hits, queries = metrics["pagedserve_prefix_cache_hits_total"], metrics["pagedserve_prefix_cache_queries_total"]
    assert 0 < hits <= queries <= metrics["pagedserve_prompt_tokens_total"]
    assert queries == metrics["pagedserve_prompt_tokens_total"]  # each of the 14 prompts looked up once


def test_the_scheduler_and_the_worker_time_the_same_steps(burst_server):
    scheduler, worker = burst_server.metrics("scheduler"), burst_server.metrics("worker")
    steps = scheduler["pagedserve_steps_total"]
    assert steps > 0
    assert scheduler['pagedserve_step_phase_seconds_count{phase="schedule"}'] >= steps  # also plans that ran nothing
    assert scheduler["pagedserve_tokens_per_step_count"] == steps
    assert scheduler["pagedserve_tokens_per_step_sum"] == scheduler["pagedserve_tokens_scheduled_total"]
    for phase in ("forward", "transfer", "sample"):
        assert worker[f'pagedserve_step_phase_seconds_count{{phase="{phase}",rank="0"}}'] == steps
    assert scheduler['pagedserve_request_queue_time_seconds_count{priority="default",tenant="none"}'] == 14


def test_the_worker_says_how_it_computes_and_which_kernels_run(burst_server):
    from kernels.cpu_linear import gemm_build

    [info] = [name for name in burst_server.metrics("worker") if name.startswith("pagedserve_worker_compute_info")]
    build = gemm_build()
    kernels = f"{build.variant} ({build.description})" if build else "torch"
    # llama_dir is a float32 checkpoint: auto keeps float32, the exact path
    assert (
        'activations="float32"' in info
        and 'device="cpu"' in info
        and 'weights="float32"' in info
        and f'kernels="{kernels}"' in info
        and 'rank="0"' in info
    ), info
