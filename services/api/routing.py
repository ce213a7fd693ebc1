"""Which engine serves a request, when the api fronts several (`--data-parallel-size`).

- round_robin: each in turn.
- least_load: the engine with the fewest requests.
- prefix: the engines ranked by rendezvous hashing of the prompt's first blocks (the prefix
  cache's own key chain), so that requests sharing a system prompt go where its blocks are
  cached; the first engine in that order whose load is within a bound of the mean (1.5 times it,
  and 4 requests) takes it, so one hot prefix cannot pile onto one engine.

Rendezvous hashing needs no shared state: api replicas given the same engines rank them alike,
and an engine that comes or goes moves only the prefixes it ranks first.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from shared.prefix_keys import prefix_key

POLICIES = ("round_robin", "least_load", "prefix")
PREFIX_BLOCKS = 8  # the blocks of a prompt that choose its engine: 128 tokens at the default block size
LOAD_BOUND = 1.5  # an engine over this times the mean load, plus LOAD_SLACK requests, takes no prefix beyond its own
LOAD_SLACK = 4  # so that a few requests on an otherwise idle cluster do not scatter a prefix
FULL_KV = 0.98  # an engine with requests waiting and this share of its KV blocks in use counts as full


@dataclass(slots=True)
class EngineLoad:
    """What the router knows of one engine that is up."""

    name: str  # its endpoint: the same on every api replica
    in_flight: int  # this api's requests on it
    running: int = 0  # as the engine last reported (all apis' requests)
    waiting: int = 0
    kv_usage: float = 0.0

    @property
    def requests(self) -> int:
        return max(self.in_flight, self.running + self.waiting)

    @property
    def full(self) -> bool:
        return self.waiting > 0 and self.kv_usage >= FULL_KV


class Router:
    def __init__(self, policy: str, prefix_blocks: int = PREFIX_BLOCKS, load_bound: float = LOAD_BOUND,
                 load_slack: int = LOAD_SLACK):
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}")
        self.policy = policy
        self.prefix_blocks = prefix_blocks
        self.load_bound = load_bound
        self.load_slack = load_slack
        self._turn = itertools.count()

    def choose(self, engines: Sequence[EngineLoad], token_ids: Sequence[int], block_size: int,
               cache_salt: str = "") -> int:
        """The index in `engines` (those up, never empty) of the one to serve this prompt."""
        if len(engines) == 1:
            return 0
        if self.policy == "round_robin":
            return next(self._turn) % len(engines)
        key = prefix_key(token_ids, block_size, self.prefix_blocks, cache_salt)
        order = sorted(range(len(engines)), key=lambda i: _score(key, engines[i].name), reverse=True)
        if self.policy == "least_load" or len(token_ids) < block_size:  # no full block: nothing to share
            return _least_loaded(engines, order)
        bound = self.load_bound * (sum(e.requests for e in engines) + 1) / len(engines) + self.load_slack
        for index in order:
            if engines[index].requests < bound and not engines[index].full:
                return index
        return _least_loaded(engines, order)


def _least_loaded(engines: Sequence[EngineLoad], order: list[int]) -> int:
    """Ties go by the prompt's rendezvous order, not always to the first engine."""
    return min(order, key=lambda i: (engines[i].full, engines[i].requests))


def _score(key: bytes, name: str) -> bytes:
    return hashlib.sha256(key + name.encode()).digest()[:8]
