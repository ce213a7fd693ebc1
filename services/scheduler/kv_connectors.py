"""KV connectors, the scheduler's side: the one way KV enters or leaves the engine.

The KV cache manager holds a list of connectors and drives each through this interface; its counterpart in the
workers (services/worker/kv_connectors.py) carries out what they queue:

- loads: which of a starting request's prompt blocks a connector can bring in from outside (those no tier of the
  engine holds), started once the manager allowed them (`start_loads`; True: asynchronously, and the request
  waits while `is_loading` says so), or at once where they are in host memory (the prefix tiers' match);
- saves: a device block just cached (`cached`), evicted (`evicted`), or a finished request whose blocks must be
  kept until another engine has them (`finished`);
- each step's part: block transfers on the manager's list, and messages of the connector's own (`take`);
- results: transfers done or failed (`on_result`), and a failed step's transfers abandoned (`abandon`).

The connectors are the prefix tiers in host memory and files (services/scheduler/prefix_tiers.py) and other
engines (services/scheduler/remote_kv.py). A request waiting for a load is the manager's state alone: the
planner and the queues only see that it cannot start yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.request import Request, Sequence
    from shared.protocol import StepResult


class KVConnector:
    def start_loads(self, seq: Sequence, holds: Callable[[bytes], bool]) -> bool:
        """Start loading the sequence's prompt blocks that no tier holds (`holds`, by prefix key) and this
        connector can bring in; True if the request must wait for them."""
        return False

    def is_loading(self, request: Request) -> bool:
        return False

    def loading_keys(self) -> set[bytes]:
        """Prefix keys of blocks on their way in: no other connector loads them too."""
        return set()

    def cached(self, block: int, key: bytes, chunk: tuple[int, ...]) -> None:
        """A device block was just cached under `key`."""

    def evicted(self, block: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """The device evicts a cached block."""

    def finished(self, seq: Sequence, reason: str) -> None:
        """A sequence ends, before its blocks are freed: a connector that sends them elsewhere holds them."""

    def on_result(self, result: StepResult) -> None:
        """Transfers a step's result reports done or failed."""

    def abandon(self) -> None:
        """A step failed and the workers forgot its transfers in flight: nothing of them is relied on."""

    @property
    def has_messages(self) -> bool:
        """Whether the next step carries something of this connector's beyond block transfers."""
        return False

    @property
    def pending(self) -> bool:
        """Transfers the workers started and have not reported yet."""
        return False

    def held_device_blocks(self) -> dict[int, int]:
        """Device blocks it holds references to, with their count, for the manager's audit."""
        return {}

    def stats(self) -> dict[str, int]:
        """Its counts, by the names of the scheduler's `Stats` fields."""
        return {}


class Connectors:
    """The manager's connectors, driven as one. `holds`: whether a tier of the engine holds a block of this key."""

    def __init__(self, connectors: list[KVConnector], holds: Callable[[bytes], bool]):
        self.all, self.holds = connectors, holds
        self._loads_started: set[str] = set()  # requests whose loads from outside were started (once each)

    def ready_to_start(self, request: Request) -> bool:
        """Whether a waiting request may start now: no connector is loading blocks for it. Asked the first time,
        the connectors start loading what they can of its prompt that the engine holds in no tier, and it waits
        for them; once only, so that blocks loaded and lost again before it starts are computed."""
        if any(connector.is_loading(request) for connector in self.all):
            return False
        if request.request_id in self._loads_started or request.whole_prompt or request.prompt_logprobs is not None:
            return True
        self._loads_started.add(request.request_id)
        seq, loading = request.seqs[0], set().union(*(c.loading_keys() for c in self.all))
        started = [c.start_loads(seq, lambda key: self.holds(key) or key in loading) for c in self.all]
        return not any(started)

    def forget(self, request: Request) -> None:
        """The request ended."""
        self._loads_started.discard(request.request_id)

    def cached(self, block: int, key: bytes, chunk: tuple[int, ...]) -> None:
        for connector in self.all:
            connector.cached(block, key, chunk)

    def evicted(self, block: int, key: bytes, tokens: tuple[int, ...]) -> None:
        for connector in self.all:
            connector.evicted(block, key, tokens)

    def finished(self, seq: Sequence, reason: str) -> None:
        for connector in self.all:
            connector.finished(seq, reason)

    def on_result(self, result: StepResult) -> None:
        for connector in self.all:
            connector.on_result(result)

    def abandon(self) -> None:
        for connector in self.all:
            connector.abandon()

    @property
    def has_messages(self) -> bool:
        return any(connector.has_messages for connector in self.all)

    @property
    def pending(self) -> bool:
        return any(connector.pending for connector in self.all)

    def held_device_blocks(self) -> dict[int, int]:
        held: dict[int, int] = {}
        for connector in self.all:
            for block, count in connector.held_device_blocks().items():
                held[block] = held.get(block, 0) + count
        return held

    def stats(self) -> dict[str, int]:
        return {name: count for connector in self.all for name, count in connector.stats().items()}
