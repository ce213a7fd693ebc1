"""KV blocks that come from, or go to, another engine (prefill/decode disaggregation): the scheduler's side.

A producer (`AddRequest.kv_send`) computes a prompt; as the request ends, its full prompt blocks are held and
exported to its worker's KV server under a random token, and the request's last output says where they are
(`KVHandoff`). They stay held until the api that sent the request releases them (an `Abort` of its id, once the
decode engine has them) or for `hold_seconds` at most.

A consumer (`AddRequest.kv_source`) looks up the prompt's full blocks in its own prefix cache first (the keys are
salted by tenant and adapter as every prefix key is), allocates device blocks for the rest, and has its worker
fetch them, off the steps. A fetched block enters the device's prefix cache under its key, so the request then
starts as any request on cached blocks; a fetch that fails only leaves those blocks to be computed. While a
fetch is in flight the request waits at the head of its queue, as for a read from disk.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.block_pool import BlockPool
from services.scheduler.kv_connectors import KVConnector
from shared.prefix_keys import block_keys
from shared.protocol import KVExport, KVHandoff, RemoteLoad

if TYPE_CHECKING:
    from services.scheduler.request import Request, Sequence
    from shared.protocol import StepResult


@dataclass(slots=True)
class Held:
    token: bytes
    blocks: list[int]
    deadline: float
    handoff: KVHandoff


@dataclass(slots=True)
class Fetching:
    request_id: str
    blocks: list[tuple[int, bytes, tuple[int, ...]]]  # (device block, key, tokens) per block fetched


@dataclass(slots=True)
class RemoteCounts:
    """What the metrics read: blocks sent and fetched, fetches failed, blocks held for a consumer now."""

    blocks_exported: int = 0
    blocks_fetched: int = 0
    fetches_failed: int = 0
    holds_expired: int = 0


class RemoteKV(KVConnector):
    def __init__(self, device_pool: BlockPool, block_size: int, clock: Callable[[], float] = time.monotonic):
        self.device_pool, self.block_size, self.clock = device_pool, block_size, clock
        self.address = ""  # the producer worker's KV server, from its Ready
        self.layout = ""
        self.hold_seconds = 30.0
        self.consumes = False  # whether requests may bring a KVHandoff to fetch from
        self.held: dict[str, Held] = {}  # request id -> its exported blocks
        self.fetching: dict[int, Fetching] = {}  # load id -> what it fetches
        self.counts = RemoteCounts()
        self._exports: list[KVExport] = []
        self._ends: list[bytes] = []
        self._loads: list[RemoteLoad] = []
        self._next_load = 0

    # --- producer ----------------------------------------------------------------------------

    def finished(self, seq: Sequence, reason: str) -> None:
        """A sending request ends with its prompt computed: keep its full prompt blocks (one reference each) and
        export them."""
        request = seq.request
        if not request.kv_send or reason not in ("stop", "length") or seq.kv.num_computed < seq.num_prompt_tokens:
            return
        if not self.address or request.request_id in self.held:  # not a producer; or a second sample of it
            return
        count = min((seq.num_prompt_tokens - 1) // self.block_size, len(seq.kv.block_table))
        blocks = list(seq.kv.block_table[:count])
        for block in blocks:
            self.device_pool.share(block)
        token = os.urandom(16)
        handoff = KVHandoff(self.address, token, blocks, self.block_size, self.layout)
        self.held[request.request_id] = Held(token, blocks, self.clock() + self.hold_seconds, handoff)
        self._exports.append(KVExport(token, blocks))
        self.counts.blocks_exported += len(blocks)

    def handoff(self, request_id: str) -> KVHandoff | None:
        held = self.held.get(request_id)
        return held.handoff if held is not None else None

    def release(self, request_id: str) -> bool:
        """The consumer has the blocks, or gave up on them: they go back (cached) and the export ends."""
        held = self.held.pop(request_id, None)
        if held is None:
            return False
        self._ends.append(held.token)
        for block in held.blocks:
            self.device_pool.release(block)
        return True

    def expire(self) -> list[str]:
        """Release what no consumer fetched in time; the ids of those requests."""
        now = self.clock()
        expired = [r for r, held in self.held.items() if held.deadline <= now]
        for request_id in expired:
            self.release(request_id)
            self.counts.holds_expired += 1
        return expired

    def due_in(self) -> float | None:
        """Seconds until the next hold expires; None while nothing is held."""
        deadline = min((held.deadline for held in self.held.values()), default=None)
        return None if deadline is None else max(0.0, deadline - self.clock())

    # --- consumer ----------------------------------------------------------------------------

    def start_loads(self, seq: Sequence, holds: Callable[[bytes], bool]) -> bool:
        """Start fetching the full prompt blocks the engine holds in no tier (`holds`). False when there is none
        to fetch or no room for them: the request starts at once and computes what it lacks."""
        request = seq.request
        source = request.kv_source
        if source is None or source.block_size != self.block_size or not self.device_pool.enable_caching:
            return False
        count = min((len(request.prompt_token_ids) - 1) // self.block_size, len(source.block_ids))
        keys = block_keys(request.cache_root, seq.token_ids(), self.block_size, count)
        missing = [(index, key, chunk) for index, key, chunk in keys if not holds(key)]
        if not missing or self.device_pool.num_available < len(missing):
            return False
        blocks = [(self.device_pool.allocate(), key, chunk) for _, key, chunk in missing]
        load_id = self._next_load
        self._next_load += 1
        self.fetching[load_id] = Fetching(request.request_id, blocks)
        self._loads.append(RemoteLoad(load_id, source, [i for i, _, _ in missing], [b for b, _, _ in blocks]))
        return True

    def is_loading(self, request: Request) -> bool:
        return any(f.request_id == request.request_id for f in self.fetching.values())

    def loading_keys(self) -> set[bytes]:
        return {key for fetching in self.fetching.values() for _, key, _ in fetching.blocks}

    def on_result(self, result: StepResult) -> None:
        if result.loaded or result.failed_loads:
            self.finish(result.loaded, result.failed_loads)

    def finish(self, loaded: list[int], failed: list[int]) -> None:
        """Fetches the worker reports: the blocks of those done enter the prefix cache; those of the failed go
        back uncached."""
        for load_id in loaded + failed:
            fetching = self.fetching.pop(load_id, None)
            if fetching is None:
                continue
            ok = load_id not in failed
            self.counts.blocks_fetched += len(fetching.blocks) if ok else 0
            self.counts.fetches_failed += 0 if ok else 1
            for block, key, chunk in fetching.blocks:
                if ok:
                    self.device_pool.cache(block, key, chunk)
                self.device_pool.release(block)

    def abandon(self) -> None:
        """A step failed, and the worker waited for its fetches and forgot them: their blocks go back uncached."""
        self.finish([], list(self.fetching))

    # --- what the next step carries -----------------------------------------------------------

    @property
    def pending(self) -> bool:
        return bool(self.fetching)

    @property
    def has_messages(self) -> bool:
        return bool(self._exports or self._ends or self._loads)

    def take(self) -> tuple[list[bytes], list[KVExport], list[RemoteLoad]]:
        taken = (self._ends, self._exports, self._loads)
        self._ends, self._exports, self._loads = [], [], []
        return taken

    def stats(self) -> dict[str, int]:
        counts = self.counts
        return dict(
            blocks_exported=counts.blocks_exported,
            blocks_fetched=counts.blocks_fetched,
            fetches_failed=counts.fetches_failed,
            holds_expired=counts.holds_expired,
            blocks_held_for_fetch=sum(len(held.blocks) for held in self.held.values()),
        )

    def held_device_blocks(self) -> dict[int, int]:
        """Device blocks held for consumers, with their references, for the manager's audit."""
        counts: dict[int, int] = {}
        for held in self.held.values():
            for block in held.blocks:
                counts[block] = counts.get(block, 0) + 1
        for fetching in self.fetching.values():
            for block, _, _ in fetching.blocks:
                counts[block] = counts.get(block, 0) + 1
        return counts
