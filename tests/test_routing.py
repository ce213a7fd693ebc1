"""The api's choice of engine for a request, with several engines (`--routing`)."""

import random

import pytest

from services.api.engine_group import EngineGroup
from services.api.routing import EngineLoad, Router
from shared.prefix_keys import ROUTING_BLOCKS, ROUTING_KEY_BYTES, prefix_key, routing_key
from shared.protocol import Pong, SchedulerInfo

BLOCK = 16
NAMES = ["tcp://engine-0:5555", "tcp://engine-1:5555", "tcp://engine-2:5555"]


def idle(names=NAMES) -> list[EngineLoad]:
    return [EngineLoad(name, 0) for name in names]


def prompt(seed: int, length: int = 300) -> list[int]:
    return random.Random(seed).choices(range(1000), k=length)


def short_key(tokens: list[int], salt: str = "") -> bytes:
    return routing_key(tokens, BLOCK, salt)[:ROUTING_KEY_BYTES]


def holding(tokens: list[int], *holders: int, names=NAMES) -> list[EngineLoad]:
    """Idle engines, of which `holders` report the prompt's prefix cached."""
    loads = idle(names)
    for index in holders:
        loads[index].cached_prefixes = frozenset({short_key(tokens)})
    return loads


def test_requests_sharing_their_first_blocks_go_to_the_same_engine_whatever_follows():
    router, system = Router("prefix"), prompt(1, ROUTING_BLOCKS * BLOCK)
    chosen = {router.choose(idle(), system + prompt(suffix, 40), BLOCK) for suffix in range(20)}
    assert len(chosen) == 1  # remembered by this api until the engine's report shows it


def test_a_request_goes_to_the_engine_that_reports_its_prefix_cached():
    tokens = prompt(2)
    for holder in range(len(NAMES)):
        loads = holding(tokens, holder)
        for other in set(range(len(NAMES))) - {holder}:
            loads[other].in_flight = 0
        loads[holder].in_flight = 3  # busier than the others, within the bound
        assert Router("prefix").choose(loads, tokens, BLOCK) == holder


def test_new_prefixes_go_to_the_least_loaded_engine():
    loads = idle()
    loads[0].in_flight, loads[1].in_flight, loads[2].in_flight = 3, 1, 2
    assert Router("prefix").choose(loads, prompt(3), BLOCK) == 1


def test_a_prefix_that_two_engines_hold_goes_to_the_less_loaded_of_them():
    tokens = prompt(4)
    loads = holding(tokens, 0, 2)
    loads[0].in_flight, loads[1].in_flight, loads[2].in_flight = 3, 0, 1
    assert Router("prefix").choose(loads, tokens, BLOCK) == 2


def test_new_prefixes_on_idle_engines_spread_over_them():
    router = Router("prefix")
    counts = [0] * len(NAMES)
    for seed in range(300):
        counts[router.choose(idle(), prompt(seed), BLOCK)] += 1
    assert min(counts) > 60  # about 100 each, by the rendezvous order of their keys


def test_api_replicas_that_see_the_same_reports_agree_and_the_order_of_the_engines_does_not_matter():
    first, second = Router("prefix"), Router("prefix")
    shuffled = list(reversed(NAMES))
    for seed in range(50):
        tokens = prompt(seed)
        holder = seed % len(NAMES)
        reports = holding(tokens, holder)
        assert first.choose(reports, tokens, BLOCK) == second.choose(holding(tokens, holder), tokens, BLOCK) == holder
        fresh = prompt(1000 + seed)  # held nowhere: the rendezvous order decides
        assert (
            NAMES[Router("prefix").choose(idle(), fresh, BLOCK)]
            == shuffled[Router("prefix").choose(idle(shuffled), fresh, BLOCK)]
        )


def test_an_engine_that_goes_away_moves_only_the_prefixes_it_held():
    router = Router("prefix")
    for seed in range(200):
        tokens = prompt(seed)
        before = NAMES[router.choose(idle(), tokens, BLOCK)]
        after = NAMES[1:][Router("prefix").choose(idle(NAMES[1:]), tokens, BLOCK)]
        if before != NAMES[0]:
            assert after == before


def test_a_salt_is_part_of_the_key():
    tokens = prompt(7)
    assert prefix_key(tokens, BLOCK, ROUTING_BLOCKS, "tenant-a") != prefix_key(tokens, BLOCK, ROUTING_BLOCKS)
    loads = holding(tokens, 1)
    loads[1].in_flight = 1
    assert Router("prefix").choose(loads, tokens, BLOCK) == 1
    assert Router("prefix").choose(loads, tokens, BLOCK, "tenant-a") != 1  # another tenant's cache is not its


def test_an_engine_loaded_well_above_the_mean_takes_no_more_of_its_prefix():
    router, tokens = Router("prefix", load_bound=1.5, load_slack=4), prompt(3)
    loads = holding(tokens, 0)
    loads[0].in_flight = 10  # the others idle: the bound is 1.5 * 11 / 3 + 4 = 9.5
    assert router.choose(loads, tokens, BLOCK) != 0
    loads = holding(tokens, 0)
    loads[0].in_flight = 5  # the bound is 1.5 * 6 / 3 + 4 = 7
    assert Router("prefix").choose(loads, tokens, BLOCK) == 0


def test_an_engine_whose_kv_cache_is_full_with_requests_waiting_is_passed_over():
    tokens = prompt(4)
    loads = holding(tokens, 0)
    loads[0].waiting, loads[0].kv_usage = 1, 0.99
    assert Router("prefix").choose(loads, tokens, BLOCK) != 0


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
        self.endpoint, self.in_flight, self.load, self.cached_prefixes = endpoint, in_flight, Pong(0.0), frozenset()
        self.info = SchedulerInfo(BLOCK, 100, 1024, 2048, [0]) if up else None


def test_the_group_routes_only_to_engines_that_are_up():
    group = EngineGroup(
        [FakeClient(NAMES[0], up=False), FakeClient(NAMES[1], up=True, in_flight=5), FakeClient(NAMES[2], up=True)],
        Router("least_load"),
    )
    assert group.engines_up == [1, 2]
    assert group.choose(prompt(8)) == 2
    group.clients[2].info = None
    assert group.choose(prompt(8)) == 1
    group.clients[1].info = None
    assert group.info is None and group.choose(prompt(8)) == 0  # which answers that it is not ready
