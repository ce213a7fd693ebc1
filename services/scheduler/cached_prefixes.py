"""Which prompt prefixes this engine's prefix cache holds (on the device or in the host cache), keyed
as the api's router keys them (`shared.prefix_keys.routing_key`), for its load reports: an api that
fronts several engines then sends a request where its prefix is cached, and every api replica knows
the same."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.scheduler.kv_cache_manager import KVCacheManager
from shared.prefix_keys import ROUTING_KEY_BYTES, routing_key

REMEMBERED = 4096  # routing keys of the latest requests, checked against the cache at each report
REPORTED = 1024  # at most this many in a report (16 KiB frames), the latest first


class CachedPrefixes:
    def __init__(self, kv_cache: KVCacheManager, block_size: int):
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.latest: OrderedDict[bytes, None] = OrderedDict()

    def note(self, token_ids: Sequence[int], cache_salt: str) -> None:
        """A request arrived: its prefix will be cached once its prompt is computed."""
        if not self.kv_cache.caching:
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
            if self.kv_cache.holds(key):  # in any tier: a request sent here would not compute it
                held.append(key[:ROUTING_KEY_BYTES])
                if len(held) == REPORTED:
                    break
        return held
