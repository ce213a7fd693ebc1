"""LoRA adapters in pages of the device KV pool (S-LoRA's unified paging), on the scheduler's side.

An adapter on the device holds as many blocks of the device pool as its matrices take (its
pages), and the workers write it into them (`LoraLoad`). While a request that runs under it
is running, its pages are referenced (a swapped-out request holds none: it takes them again,
or has the adapter loaded again, when it is swapped back in); once none is, they stay in the pool as cached
blocks, so they count as available and are evicted, least recently used first, with the cached
prefix blocks when an allocation needs room. A request that needs an adapter no longer in the
pool has it loaded again. At most `max_loras` adapters are in the pool at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from services.scheduler.block_pool import BlockPool
from shared.lora import page_layout
from shared.protocol import LoraLoad, LoraRef

PAGE_KEY = b"lora-page\0"  # the start of an adapter page's key in the pool; no prefix-cache key starts so


@dataclass(slots=True)
class _OnDevice:
    pages: list[int]
    users: set[str]  # ids of the requests that hold it


class AdapterPages:
    def __init__(
        self, pool: BlockPool, max_loras: int, half_elements: int, dims: dict[str, list[int]], label_limit: int = 0
    ):
        self.pool = pool
        self.label_limit = max(label_limit, max_loras)  # adapter names counted requests by; then "other"
        self.requests: dict[str, int] = {}  # adapter name (or "other") -> requests admitted
        self.max_loras = max_loras
        self.half_elements = half_elements  # values of an adapter a block holds in each layer, per half
        self.dims = dims
        self.on_device: OrderedDict[str, _OnDevice] = OrderedDict()  # the least recently used first
        self._loads: list[LoraLoad] = []
        self.loads = 0  # adapters loaded, since the start
        self.evictions = 0

    def count_request(self, lora: LoraRef | None) -> None:
        name = lora.name if lora is not None else ""
        if name not in self.requests and len(self.requests) >= self.label_limit + 2:  # with "" and "other"
            name = "other"
        self.requests[name] = self.requests.get(name, 0) + 1

    @property
    def num_pages(self) -> int:
        return sum(len(held.pages) for held in self.on_device.values())

    def problem(self, lora: LoraRef) -> str | None:
        """Why the adapter cannot run on this model, or None."""
        if not lora.name or any(p not in self.dims for p in lora.targets):
            return f"adapter {lora.name!r} changes projections this model has not"
        return None

    def pages_for(self, lora: LoraRef) -> int:
        return page_layout(lora.rank, lora.targets, self.dims, self.half_elements)[0]

    def blocks_to_start(self, lora: LoraRef | None) -> int:
        """Available blocks a request of this adapter takes when it starts: its pages, unless a running
        request already holds them."""
        if lora is None:
            return 0
        held = self.on_device.get(lora.key)
        return 0 if held is not None and held.users else self.pages_for(lora)

    def can_start(self, lora: LoraRef | None) -> bool:
        """Whether the adapter is on the device, or may be loaded without evicting one a request holds."""
        if lora is None or lora.key in self.on_device or len(self.on_device) < self.max_loras:
            return True
        return any(not held.users for held in self.on_device.values())

    def acquire(self, request_id: str, lora: LoraRef) -> None:
        """The request starts under the adapter: its pages are referenced, loaded first if need be."""
        held = self.on_device.get(lora.key)
        if held is not None and not held.users:  # idle: every page still cached (`evicted` drops it at the first)
            for page in held.pages:
                self.pool.share(page)
        if held is None:
            while len(self.on_device) >= self.max_loras:
                idle = next(name for name, other in self.on_device.items() if not other.users)
                self._drop(idle)
            held = self.on_device[lora.key] = _OnDevice([], set())
            held.pages = self._allocate(self.pages_for(lora))
            self._loads.append(LoraLoad(lora.name, lora.path, list(held.pages), lora.key))
            self.loads += 1
        held.users.add(request_id)
        self.on_device.move_to_end(lora.key)

    def _allocate(self, count: int) -> list[int]:
        """Consecutive blocks where the pool has such a run (the workers then read the adapter in place), of
        free blocks before any that would evict cached ones (an idle adapter's pages among them), else any."""
        for uncached in (True, False):
            if any(length >= count for _, length in self.pool.free_runs(uncached)):
                return self.pool.allocate_run(count, uncached)
        return [self.pool.allocate() for _ in range(count)]

    def release(self, request_id: str, lora: LoraRef | None) -> None:
        """The request no longer runs under the adapter (finished, or preempted by recompute); the last one
        to go leaves its pages cached in the pool."""
        held = self.on_device.get(lora.key) if lora is not None else None
        if held is None or request_id not in held.users:
            return
        held.users.discard(request_id)
        if not held.users:
            assert lora is not None
            for i, page in enumerate(held.pages):
                self.pool.keep(page, self._key(lora.key, i))
                self.pool.release(page)

    def evicted(self, key: bytes) -> bool:
        """The pool evicted a cached block with this key: if an adapter page, the adapter leaves the device.
        Returns whether it was one."""
        if not key.startswith(PAGE_KEY):
            return False
        name = key[len(PAGE_KEY) :].rsplit(b"\0", 1)[0].decode()
        if name in self.on_device:
            self._drop(name)
        return True

    def _drop(self, name: str) -> None:
        held = self.on_device.pop(name)
        for page in held.pages:
            self.pool.uncache(page)
        self.evictions += 1

    def held_pages(self) -> dict[int, int]:
        """Block -> references held by adapters (one per referenced page)."""
        return {page: 1 for held in self.on_device.values() if held.users for page in held.pages}

    def take_loads(self) -> list[LoraLoad]:
        loads, self._loads = self._loads, []
        return loads

    @staticmethod
    def _key(name: str, index: int) -> bytes:
        return PAGE_KEY + name.encode() + b"\0" + str(index).encode()
