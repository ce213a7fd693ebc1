"""Whether a step speculates is chosen by what speculating and not speculating gave lately, per
batch size: on a machine where a batch is compute-bound, speculation stops costing throughput."""

from __future__ import annotations

import pytest

from services.scheduler.speculation import AdaptiveSwitch

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


def run(switch: AdaptiveSwitch, batch: int, steps: int, worker_ms) -> list[bool]:
    """Steps of `batch` decoding sequences; `worker_ms(speculated)` is what a step costs and
    speculating gives 1.5 tokens per sequence, plain decoding one."""
    choices = []
    for _ in range(steps):
        speculated = switch.choose(batch)
        choices.append(speculated)
        tokens = round(batch * (1.5 if speculated else 1.0))
        switch.observe(batch, speculated, tokens, worker_ms(speculated))
    return choices


def test_it_speculates_where_speculating_gives_more_tokens_per_millisecond():
    choices = run(AdaptiveSwitch(), batch=1, steps=1000, worker_ms=lambda speculated: 5.5 if speculated else 5.0)
    assert sum(choices[100:]) / 900 > 0.95  # all but the probes of plain decoding


def test_where_proposals_cost_more_than_they_give_it_stops_and_its_probes_cost_about_one_percent():
    # Speculating gives 1.5 tokens in twice the time: a quarter less per millisecond.
    choices = run(AdaptiveSwitch(), batch=48, steps=3000, worker_ms=lambda speculated: 30.0 if speculated else 15.0)
    switch = AdaptiveSwitch
    assert sum(choices[:100]) <= switch.WARMUP + switch.PROBE_STEPS  # the warm-up and the first probe
    share = sum(choices[100:]) / 2900  # what probes cost: share x 25 % of the rate
    assert share * 0.25 <= 2 * switch.PROBE_COST


def test_batch_sizes_are_judged_apart():
    switch = AdaptiveSwitch()
    small = run(switch, batch=1, steps=500, worker_ms=lambda speculated: 5.5 if speculated else 5.0)
    large = run(switch, batch=48, steps=500, worker_ms=lambda speculated: 30.0 if speculated else 15.0)
    assert sum(small[-200:]) > 190 and sum(large[-200:]) < 20


def test_a_change_of_verdict_is_found_by_the_probes():
    switch = AdaptiveSwitch()
    run(switch, batch=4, steps=2000, worker_ms=lambda speculated: 12.0 if speculated else 6.0)
    # The text turns repetitive: now speculating pays.
    after = run(switch, batch=4, steps=2000, worker_ms=lambda speculated: 6.5 if speculated else 6.0)
    assert sum(after[-500:]) > 480
