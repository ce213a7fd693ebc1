"""Which engine serves a request, when the api fronts several (`--data-parallel-size`).

- round_robin: each in turn.
- least_load: the engine with the fewest requests.
- prefix: where the prompt's first blocks are cached. Each engine reports, with its load, the
  routing keys (`shared.prefix_keys.routing_key`) its prefix cache holds; a request goes to the
  least loaded engine holding its key, unless that one is loaded well above the mean (1.5 times
  it, and 4 requests), so one hot prefix cannot pile onto one engine. A prefix no engine holds
  goes to the least loaded, so new prefixes spread evenly, and this api remembers where it sent
  each for a few seconds, until that engine's report shows it.

Ties go by rendezvous hashing of the key over the engines' endpoints. Api replicas that see the
same reports and loads therefore choose alike, without talking to each other.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.prefix_keys import ROUTING_KEY_BYTES, routing_key

POLICIES = ("round_robin", "least_load", "prefix")
LOAD_BOUND = 1.5  # an engine over this times the mean load, plus LOAD_SLACK requests, takes no more of a prefix
LOAD_SLACK = 4  # so that a few requests on an otherwise idle cluster do not scatter a prefix
FULL_KV = 0.98  # an engine with requests waiting and this share of its KV blocks in use counts as full
REMEMBER_SECONDS = 5.0  # how long this api counts a prefix as held where it sent it, unreported
REMEMBERED = 65536  # prefixes remembered at most


@dataclass(slots=True)
class EngineLoad:
    """What the router knows of one engine that is up."""

    name: str  # its endpoint: the same on every api replica
    in_flight: int  # this api's requests on it
    running: int = 0  # as the engine last reported (all apis' requests)
    waiting: int = 0
    kv_usage: float = 0.0
    cached_prefixes: frozenset[bytes] = field(default_factory=frozenset)  # routing keys, cut short

    @property
    def requests(self) -> int:
        return max(self.in_flight, self.running + self.waiting)

    @property
    def full(self) -> bool:
        return self.waiting > 0 and self.kv_usage >= FULL_KV


class Router:
    def __init__(self, policy: str, load_bound: float = LOAD_BOUND, load_slack: int = LOAD_SLACK):
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}")
        self.policy = policy
        self.load_bound = load_bound
        self.load_slack = load_slack
        self._turn = itertools.count()
        self._sent: dict[bytes, tuple[str, float]] = {}  # routing key -> (engine, until when) of late choices

    def choose(
        self,
        engines: Sequence[EngineLoad],
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str = "",
        adapter: str = "",
    ) -> int:
        """The index in `engines` (those up, never empty) of the one to serve this prompt."""
        if len(engines) == 1:
            return 0
        if self.policy == "round_robin":
            return next(self._turn) % len(engines)
        key = routing_key(token_ids, block_size, cache_salt, adapter)
        order = sorted(range(len(engines)), key=lambda i: _score(key or b"", engines[i].name), reverse=True)
        if self.policy == "least_load" or key is None:  # no full block: nothing to share
            return _least_loaded(engines, order)
        short, now = key[:ROUTING_KEY_BYTES], time.monotonic()
        sent, until = self._sent.get(short, ("", 0.0))
        bound = self.load_bound * (sum(e.requests for e in engines) + 1) / len(engines) + self.load_slack
        holders = [i for i in order if short in engines[i].cached_prefixes or (engines[i].name == sent and until > now)]
        within = [i for i in holders if engines[i].requests < bound and not engines[i].full]
        choice = _least_loaded(engines, within or order)
        self._remember(short, engines[choice].name, now)
        return choice

    def _remember(self, short: bytes, engine: str, now: float) -> None:
        if len(self._sent) >= REMEMBERED:
            self._sent = {k: v for k, v in self._sent.items() if v[1] > now}
            while len(self._sent) >= REMEMBERED:  # all recent: drop the oldest
                del self._sent[next(iter(self._sent))]
        self._sent.pop(short, None)  # re-inserted last: the dict stays in order of time
        self._sent[short] = (engine, now + REMEMBER_SECONDS)


def _least_loaded(engines: Sequence[EngineLoad], order: list[int]) -> int:
    """Ties go by the prompt's rendezvous order, not always to the first engine."""
    return min(order, key=lambda i: (engines[i].full, engines[i].requests))


def _score(key: bytes, name: str) -> bytes:
    return hashlib.sha256(key + name.encode()).digest()[:8]
