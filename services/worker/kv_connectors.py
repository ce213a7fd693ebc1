"""KV connectors, the worker's side: the one way KV enters or leaves its cache.

A connector carries out the kinds of block transfer it names (`moves`) and its part of each step (`start`), off
the step where it can; `pending` lists what it has in flight, for a step with nothing to compute to wait on, and
`collect` reports what finished since it last did, into the step's result. After a failed step `forget` waits
for what is in flight and drops it: the scheduler recomputes whatever it carried.

- `HostConnector`: the swap space and the host cache in host memory (swap out and in, offload and load).
- `DiskConnector`: block files under `--kv-cache-dir`, written from the device, read into the host cache.
- `RemoteConnector`: other engines (prefill/decode disaggregation): a prefill engine's exports, a decode
  engine's fetches (services/worker/kv_transport.py).

Copies within the device (copy-on-write) are not a connector's: KV neither enters nor leaves.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from services.worker.disk_tier import DiskTier
from services.worker.kv_transport import KVServer, fetch_blocks, read_secret
from services.worker.model_config import ModelLoadError
from shared.kv_transfer_config import KVTransferConfig
from shared.protocol import DEVICE, DISK, HOST, BlockTransfer, RemoteLoad, Step

if TYPE_CHECKING:
    from services.worker.kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ConnectorReport:
    """Transfers finished since the last report, as a step's result carries them."""

    reads: list[bytes] = field(default_factory=list)  # keys of block files read whole
    failed_reads: list[bytes] = field(default_factory=list)
    loaded: list[int] = field(default_factory=list)  # RemoteLoad ids fetched
    failed_loads: list[int] = field(default_factory=list)


class WorkerConnector:
    moves: tuple[tuple[int, int], ...] = ()

    def run(self, transfers: list[BlockTransfer]) -> None:
        """Carry out a run of transfers of one of `moves`, in order (or start them)."""
        raise NotImplementedError

    def start(self, step: Step) -> None:
        """Its part of a step beyond block transfers, before the forward."""

    def pending(self) -> list[Future[Any]]:
        return []

    def collect(self, report: ConnectorReport) -> None:
        """Add what finished since the last call."""

    def forget(self) -> None:
        """Wait for what is in flight, and drop it unreported."""

    def close(self) -> None:
        pass


class HostConnector(WorkerConnector):
    moves = ((DEVICE, HOST), (HOST, DEVICE))

    def __init__(self, cache: KVCache):
        self.cache = cache

    def run(self, transfers: list[BlockTransfer]) -> None:
        out = (transfers[0].src_tier, transfers[0].dst_tier) == (DEVICE, HOST)
        pairs = [(t.src_block, t.dst_block) for t in transfers]
        # Blocks read from disk into these host blocks land before anything else touches them (the scheduler moves
        # a block only once rank 0 reported its read, which another rank's may trail).
        self.cache.await_reads([dst if out else src for src, dst in pairs])
        (self.cache.swap_out if out else self.cache.swap_in)(pairs)


class DiskConnector(WorkerConnector):
    moves = ((DEVICE, DISK), (DISK, HOST))

    def __init__(self, cache: KVCache, tier: DiskTier):
        self.cache, self.tier = cache, tier
        self.reads: dict[int, tuple[bytes, Future[bool]]] = {}  # host block -> its read in flight

    def run(self, transfers: list[BlockTransfer]) -> None:
        if transfers[0].src_tier == DEVICE:  # gathered at once, written in the background
            blocks = self.cache.gather([t.src_block for t in transfers])
            self.tier.write_many([t.key for t in transfers], blocks)
            return
        self.cache.finish_swaps()  # a write-back to these host blocks may still be on its way
        for t in transfers:
            self.reads[t.dst_block] = (t.key, self.tier.start_read(t.key, self.cache.swap_space[:, :, t.dst_block]))

    def await_blocks(self, host_blocks: list[int]) -> None:
        for block in host_blocks:
            if block in self.reads:
                self.reads[block][1].result()

    def pending(self) -> list[Future[Any]]:
        return [future for _, future in self.reads.values()]

    def collect(self, report: ConnectorReport) -> None:
        for block, (key, future) in list(self.reads.items()):
            if future.done():
                del self.reads[block]
                (report.reads if not future.exception() and future.result() else report.failed_reads).append(key)

    def forget(self) -> None:
        for _, future in self.reads.values():
            future.exception()  # waits; a read that raised is only forgotten
        self.reads.clear()

    def close(self) -> None:
        self.tier.close()


class RemoteConnector(WorkerConnector):
    def __init__(self, cache: KVCache, server: KVServer | None, secret: bytes | None, context: Any):
        self.cache, self.server, self.secret, self.context = cache, server, secret, context
        self.fetches: dict[int, Future[tuple[int, float]]] = {}  # RemoteLoad.load_id -> its fetch in flight
        self._fetcher: ThreadPoolExecutor | None = None
        self._fetched: list[tuple[int, float]] = []  # (bytes, seconds) of fetches done, for the metrics

    def start(self, step: Step) -> None:
        """Exports end first (their blocks may be written from this step on, and no answer reads them after
        this), then exports begin and fetches start."""
        if self.server is not None:
            for token in step.kv_export_ends:
                self.server.end(token)
            for export in step.kv_exports:
                self.server.export(export.token, export.block_ids)
        for load in step.remote_loads:
            if self._fetcher is None:
                self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-fetch")
            self.fetches[load.load_id] = self._fetcher.submit(self._fetch, load)

    def _fetch(self, load: RemoteLoad) -> tuple[int, float]:
        if load.source.layout != self.cache.layout:
            raise ValueError(f"a {load.source.layout} cache's blocks, where this one is {self.cache.layout}")
        source, started = load.source, time.perf_counter()
        size = fetch_blocks(
            self.cache.cache, source.address, source.token, load.src_blocks, load.dst_blocks, self.secret, self.context
        )
        return size, time.perf_counter() - started

    def take_fetched(self) -> list[tuple[int, float]]:
        fetched, self._fetched = self._fetched, []
        return fetched

    def pending(self) -> list[Future[Any]]:
        return list(self.fetches.values())

    def collect(self, report: ConnectorReport) -> None:
        for load_id, future in list(self.fetches.items()):
            if future.done():
                del self.fetches[load_id]
                if future.exception() is None:
                    report.loaded.append(load_id)
                    self._fetched.append(future.result())
                else:
                    log.warning("fetching KV blocks failed (they are computed instead): %s", future.exception())
                    report.failed_loads.append(load_id)

    def forget(self) -> None:
        for fetch in self.fetches.values():  # it writes into device blocks: done before they are reused
            fetch.exception()
        self.fetches.clear()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def attach(cache: KVCache, config: KVTransferConfig, world_size: int) -> str:
    """Give a worker's cache its connector to other engines: a producer's server, a consumer's fetches. Returns the
    address the server answers on ("" for a consumer only)."""
    if world_size != 1:
        raise ModelLoadError(
            "--kv-transfer-config works with one worker rank per engine (-tp 1) for now: a tensor-parallel engine "
            "would fetch each rank's heads from the matching rank"
        )
    try:
        secret = read_secret(config.key_file) if config.key_file else None
        context: zmq.Context = zmq.Context.instance()  # type: ignore[type-arg]
        server = KVServer(cache.cache, config.bind_endpoint, secret, context) if config.produces else None
    except (OSError, ValueError, zmq.ZMQError) as exc:
        raise ModelLoadError(f"--kv-transfer-config: {exc}") from None
    cache.connect_remote(RemoteConnector(cache, server, secret, context))
    return config.endpoint if config.produces else ""
