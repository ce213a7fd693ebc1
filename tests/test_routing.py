"""The api's choice of engine for a request, with several engines (`--routing`)."""

import random

import pytest

from services.api.engine_group import EngineGroup
from services.api.routing import PREFIX_BLOCKS, EngineLoad, Router
from shared.prefix_keys import prefix_key
from shared.protocol import Pong, SchedulerInfo

BLOCK = 16
NAMES = ["tcp://engine-0:5555", "tcp://engine-1:5555", "tcp://engine-2:5555"]


def idle(names=NAMES) -> list[EngineLoad]:
    return [EngineLoad(name, 0) for name in names]


def prompt(seed: int, length: int = 300) -> list[int]:
    return random.Random(seed).choices(range(1000), k=length)


def test_requests_sharing_their_first_blocks_go_to_the_same_engine_whatever_follows():
    router, system = Router("prefix"), prompt(1, PREFIX_BLOCKS * BLOCK)
    chosen = {router.choose(idle(), system + prompt(suffix, 40), BLOCK) for suffix in range(20)}
    assert len(chosen) == 1


def test_different_prefixes_spread_over_the_engines():
    router = Router("prefix")
    counts = [0] * len(NAMES)
    for seed in range(300):
        counts[router.choose(idle(), prompt(seed), BLOCK)] += 1
    assert min(counts) > 60  # about 100 each


def test_api_replicas_agree_without_talking_and_the_order_of_the_engines_does_not_matter():
    first, second = Router("prefix"), Router("prefix")
    shuffled = list(reversed(NAMES))
    for seed in range(50):
        tokens = prompt(seed)
        assert first.choose(idle(), tokens, BLOCK) == second.choose(idle(), tokens, BLOCK)
        assert NAMES[first.choose(idle(), tokens, BLOCK)] == shuffled[second.choose(idle(shuffled), tokens, BLOCK)]


def test_an_engine_that_goes_away_moves_only_the_prefixes_it_held():
    router = Router("prefix")
    for seed in range(200):
        tokens = prompt(seed)
        before = NAMES[router.choose(idle(), tokens, BLOCK)]
        after = NAMES[1:][router.choose(idle(NAMES[1:]), tokens, BLOCK)]
        if before != NAMES[0]:
            assert after == before


def test_a_salt_is_part_of_the_key():
    tokens = prompt(7)
    assert prefix_key(tokens, BLOCK, PREFIX_BLOCKS, "tenant-a") != prefix_key(tokens, BLOCK, PREFIX_BLOCKS)


def test_an_engine_loaded_well_above_the_mean_takes_no_more_of_its_prefix():
    router, tokens = Router("prefix", load_bound=1.5, load_slack=4), prompt(3)
    home = router.choose(idle(), tokens, BLOCK)
    loads = idle()
    loads[home].in_flight = 10  # the others idle: the bound is 1.5 * 11 / 3 + 4 = 9.5
    overflow = router.choose(loads, tokens, BLOCK)
    assert overflow != home
    loads[home].in_flight = 5  # the bound is 1.5 * 6 / 3 + 4 = 7
    assert router.choose(loads, tokens, BLOCK) == home


def test_an_engine_whose_kv_cache_is_full_with_requests_waiting_is_passed_over():
    router, tokens = Router("prefix"), prompt(4)
    home = router.choose(idle(), tokens, BLOCK)
    loads = idle()
    loads[home].waiting, loads[home].kv_usage = 1, 0.99
    assert router.choose(loads, tokens, BLOCK) != home


def test_the_load_an_engine_reports_counts_where_it_exceeds_this_apis_own():
    loads = idle(NAMES[:2])
    loads[0].running, loads[0].waiting = 6, 2  # other api replicas' requests
    loads[1].in_flight = 3
    assert Router("least_load").choose(loads, prompt(5), BLOCK) == 1


def test_round_robin_takes_the_engines_in_turn():
    router = Router("round_robin")
    assert [router.choose(idle(), prompt(0), BLOCK) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_load_takes_the_engine_with_the_fewest_requests():
    loads = idle()
    loads[0].in_flight, loads[1].in_flight, loads[2].in_flight = 4, 1, 3
    assert Router("least_load").choose(loads, prompt(6), BLOCK) == 1


def test_a_prompt_shorter_than_a_block_goes_where_the_load_is_least():
    loads = idle()
    loads[0].in_flight = loads[2].in_flight = 2
    assert Router("prefix").choose(loads, [1, 2, 3], BLOCK) == 1


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round_robin"):
        Router("random")


class FakeClient:
    def __init__(self, endpoint: str, up: bool, in_flight: int = 0):
        self.endpoint, self.in_flight, self.load = endpoint, in_flight, Pong(0.0)
        self.info = SchedulerInfo(BLOCK, 100, 1024, 2048, [0]) if up else None


def test_the_group_routes_only_to_engines_that_are_up():
    group = EngineGroup([FakeClient(NAMES[0], up=False), FakeClient(NAMES[1], up=True, in_flight=5),
                         FakeClient(NAMES[2], up=True)], Router("least_load"))
    assert group.engines_up == [1, 2]
    assert group.choose(prompt(8)) == 2
    group.clients[2].info = None
    assert group.choose(prompt(8)) == 1
    group.clients[1].info = None
    assert group.info is None and group.choose(prompt(8)) == 0  # which answers that it is not ready
