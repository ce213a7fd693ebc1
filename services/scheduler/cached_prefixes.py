"""Which prompt prefixes this engine's prefix cache holds, keyed as the api's router keys them
(`shared.prefix_keys.routing_key`), for its load reports: an api that fronts several engines then
sends a request where its prefix is cached, and every api replica knows the same."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.scheduler.block_pool import BlockPool
from shared.prefix_keys import ROUTING_KEY_BYTES, routing_key

REMEMBERED = 4096  # routing keys of the latest requests, checked against the cache at each report
REPORTED = 1024  # at most this many in a report (16 KiB frames), the latest first


class CachedPrefixes:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.latest: OrderedDict[bytes, None] = OrderedDict()

    def note(self, token_ids: Sequence[int], cache_salt: str) -> None:
        """A request arrived: its prefix will be cached once its prompt is computed."""
        if not self.pool.enable_caching:
            return
        key = routing_key(token_ids, self.block_size, cache_salt)
        if key is None:
            return
        self.latest[key] = None
        self.latest.move_to_end(key)
        if len(self.latest) > REMEMBERED:
            self.latest.popitem(last=False)

    def report(self) -> list[bytes]:
        held = []
        for key in reversed(self.latest):
            if self.pool.holds(key):
                held.append(key[:ROUTING_KEY_BYTES])
                if len(held) == REPORTED:
                    break
        return held
