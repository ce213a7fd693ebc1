"""What an engine reports of its prefix cache, for the api's prefix routing: the routing keys of
the prompts whose first blocks it holds, as the api computes them, and no others."""

from services.scheduler.cached_prefixes import CachedPrefixes
from shared.prefix_keys import ROUTING_KEY_BYTES, routing_key
from shared.protocol import AddRequest
from shared.sampling import SamplingParams
from tests.scheduler_harness import StandInWorker, make_scheduler, run_to_completion

BLOCK = 4


def served(
    prompts: list[list[int]], num_blocks: int = 64, prefix_caching: bool = True, salt: str = "", host_blocks: int = 0
):
    """Run each prompt to completion, one after another, noting each as the server does."""
    scheduler = make_scheduler(
        num_blocks=num_blocks, block_size=BLOCK, prefix_caching=prefix_caching, num_host_cache_blocks=host_blocks
    )
    prefixes = CachedPrefixes(scheduler.kv_cache, BLOCK)
    for index, prompt in enumerate(prompts):
        message = AddRequest(f"r{index}", prompt, SamplingParams(max_tokens=2, temperature=0.0), float(index), salt)
        assert scheduler.add(message) is None
        prefixes.note(prompt, salt)
        run_to_completion(scheduler, StandInWorker())
    return prefixes


def key(prompt: list[int], salt: str = "") -> bytes:
    return routing_key(prompt, BLOCK, salt)[:ROUTING_KEY_BYTES]


def test_a_served_prompts_prefix_is_reported_by_the_key_the_api_computes():
    prompt = list(range(1, 40))
    assert served([prompt]).report() == [key(prompt)]


def test_salted_prompts_are_reported_under_their_salts_key():
    prompt = list(range(1, 40))
    assert served([prompt], salt="tenant-a").report() == [key(prompt, "tenant-a")]


def test_an_evicted_prefix_is_no_longer_reported():
    first, second = list(range(1, 40)), list(range(100, 139))
    prefixes = served([first, second], num_blocks=12)  # room for one prompt's blocks: the second evicts the first
    assert prefixes.report() == [key(second)]


def test_a_prefix_the_device_evicted_into_the_host_cache_is_still_reported():
    first, second = list(range(1, 40)), list(range(100, 139))
    prefixes = served([first, second], num_blocks=12, host_blocks=16)
    assert prefixes.report() == [key(second), key(first)]


def test_nothing_is_reported_without_prefix_caching_or_for_a_prompt_under_a_block():
    assert served([list(range(1, 40))], prefix_caching=False).report() == []
    assert served([[1, 2, 3]]).report() == []
