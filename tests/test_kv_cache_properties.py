"""Random interleavings of block operations never lose, leak or double-count a block, in any tier, and
a block loaded back from the host cache holds what was written back there."""

import itertools
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.scheduler.disk_index import DiskIndex
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus, Sequence
from shared.protocol import DEVICE, DISK, LoraRef
from shared.sampling import SamplingParams

BLOCK_SIZE = 4
GPU_BLOCKS = 24
CPU_BLOCKS = 12
HOST_CACHE_BLOCKS = 8
DISK_BLOCKS = 16
EMPTY_FOLDER = tempfile.mkdtemp(prefix="pagedserve-kv-properties-")  # this process's, held by every machine of it
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=20)  # few symbols: many prefix hits


class KVCacheMachine(RuleBasedStateMachine):
    write_through = False

    def __init__(self):
        super().__init__()
        # A disk index over a folder that stays empty: these tests stand in for the worker that writes the files.
        disk = DiskIndex(EMPTY_FOLDER, "print", 1, DISK_BLOCKS)
        self.manager = KVCacheManager(
            GPU_BLOCKS,
            BLOCK_SIZE,
            CPU_BLOCKS,
            watermark=0.0,
            enable_prefix_caching=True,
            num_host_cache_blocks=HOST_CACHE_BLOCKS,
            disk=disk,
            write_through=self.write_through,
        )
        # Adapters paged into the same device pool: a few pages each.
        self.manager.enable_adapters(2, 16, {"q_proj": [8, 8], "down_proj": [8, 8]})
        self.adapter_users: dict[str, LoraRef] = {}  # request id -> the adapter it holds
        # What each block holds, as the workers would have it after the transfers: (tier, block) -> tokens
        self.contents: dict[tuple[int, int], tuple[int, ...]] = {}
        self.requests: list[Request] = []
        self.freed = []
        self.ids = itertools.count()

    def _running_seqs(self):
        return [s for r in self.requests if r.status is RequestStatus.RUNNING for s in r.seqs]

    def _compute(self, seq, num_tokens):
        self.manager.append_slots(seq, num_tokens)
        self._carry_out_transfers()
        self.manager.mark_computed(seq, num_tokens)
        size, tokens = BLOCK_SIZE, seq.token_ids()
        for index, block in enumerate(seq.kv.block_table):
            self.contents[(DEVICE, block)] = tuple(tokens[index * size : (index + 1) * size])
        self.manager.cache_full_blocks(seq)

    def _carry_out_transfers(self):
        """As a worker would, in order, and the step's result; a block read back must hold what was written
        to it (a block on disk is named by its key)."""
        reads = []
        for t in self.manager.take_transfers():
            source = (DISK, t.key) if t.src_tier == DISK else (t.src_tier, t.src_block)
            target = (DISK, t.key) if t.dst_tier == DISK else (t.dst_tier, t.dst_block)
            self.contents[target] = self.contents[source]
            if t.src_tier == DISK:
                reads.append(t.key)
        self.manager.finish_reads(reads, set())

    @precondition(lambda self: self.freed)
    @rule(data=st.data(), extra=tokens)
    def start_from_a_freed_sequences_tokens(self, data, extra):
        """Its full blocks are likely still cached: a prefix hit, or an eviction if they were reused."""
        self.start(data.draw(st.sampled_from(self.freed)).token_ids() + extra)

    @rule(prompt=tokens)
    def start_new(self, prompt):
        self.start(prompt)

    @rule(prompt=tokens)
    def a_step_that_reads_from_disk_fails(self, prompt):
        """The reads it carried never happen: their host blocks must not be found holding anything."""
        request = Request(f"r{next(self.ids)}", prompt, SamplingParams(), 0.0)
        seq = Sequence(next(self.ids), request, 0)
        request.seqs.append(seq)
        hits = self.manager.match_prefix(seq)
        if hits.reads and self.manager.read_from_disk(hits):
            for t in self.manager.take_transfers():
                target = (DISK, t.key) if t.dst_tier == DISK else (t.dst_tier, t.dst_block)
                if t.src_tier == DISK:  # not read: the host block holds whatever it held
                    self.contents[target] = ("not what was on disk",)
                else:  # what else the step carried was done
                    self.contents[target] = self.contents[(t.src_tier, t.src_block)]
            self.manager.abandon_reads()
        self.start(prompt)  # the same prompt again: found where it was (on disk, or computed), never in those blocks

    def start(self, prompt):
        request = Request(f"r{next(self.ids)}", prompt, SamplingParams(), 0.0)
        seq = Sequence(next(self.ids), request, 0)
        request.seqs.append(seq)
        hits = self.manager.match_prefix(seq)
        if hits.reads:  # read into the host cache by a step (as far as it has room), then matched without disk
            if self.manager.read_from_disk(hits):
                self._carry_out_transfers()
            hits = self.manager.match_prefix(seq, disk=False)
        remaining = seq.num_tokens - hits.num_blocks * BLOCK_SIZE
        needed = -(-seq.num_tokens // BLOCK_SIZE) - hits.num_blocks + hits.num_loads
        if needed + self.manager.revives(hits) > self.manager.device_pool.num_available:
            return
        self.manager.start(seq, hits)
        self._carry_out_transfers()
        hit_tokens = hits.num_blocks * BLOCK_SIZE
        assert seq.token_ids()[:hit_tokens] == prompt[:hit_tokens]
        for index, block in enumerate(seq.kv.block_table[: hits.num_blocks]):  # loaded or shared: the right tokens
            assert self.contents[(DEVICE, block)] == tuple(prompt[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
        self._compute(seq, remaining)
        request.status = RequestStatus.RUNNING
        self.requests.append(request)

    @precondition(lambda self: self._running_seqs())
    @rule(data=st.data(), new=tokens)
    def append(self, data, new):
        seq = data.draw(st.sampled_from(self._running_seqs()))
        if not self.manager.can_append([(seq, len(new))]):
            return
        index = len(seq.kv.block_table) - 1
        shared = seq.kv.num_computed % BLOCK_SIZE and self.manager.device_pool.ref_count(seq.kv.block_table[index]) > 1
        before = seq.kv.block_table[index]
        seq.output_token_ids.extend(new)
        self._compute(seq, len(new))
        if shared:  # the write went to a private copy; the other holders keep the original
            assert seq.kv.block_table[index] != before
            assert self.manager.device_pool.ref_count(seq.kv.block_table[index]) == 1
            assert self.manager.device_pool.ref_count(before) >= 1

    @precondition(lambda self: self._running_seqs())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._running_seqs()))
        child = Sequence(next(self.ids), parent.request, len(parent.request.seqs), list(parent.output_token_ids))
        self.manager.fork(parent, child)
        parent.request.seqs.append(child)

    @precondition(lambda self: self._running_seqs())
    @rule(data=st.data())
    def free_sequence(self, data):
        seq = data.draw(st.sampled_from(self._running_seqs()))
        self.manager.free(seq)
        seq.request.seqs.remove(seq)
        self.freed.append(seq)
        if not seq.request.seqs:
            self.requests.remove(seq.request)

    @precondition(lambda self: any(r.status is RequestStatus.RUNNING for r in self.requests))
    @rule(data=st.data())
    def swap_out(self, data):
        request = data.draw(st.sampled_from([r for r in self.requests if r.status is RequestStatus.RUNNING]))
        if self.manager.can_swap_out(request):
            self._carry_out_transfers()  # those queued before (files to write)
            held = {b for s in request.seqs for b in s.kv.block_table}
            self.manager.swap_out(request)
            moved = self.manager.take_transfers()
            assert sorted(t.src_block for t in moved) == sorted(held)
            self.contents.update({(t.dst_tier, t.dst_block): self.contents[(t.src_tier, t.src_block)] for t in moved})
            request.status = RequestStatus.SWAPPED

    @precondition(lambda self: any(r.status is RequestStatus.SWAPPED for r in self.requests))
    @rule(data=st.data())
    def swap_in(self, data):
        request = data.draw(st.sampled_from([r for r in self.requests if r.status is RequestStatus.SWAPPED]))
        if self.manager.can_swap_in(request):
            self.manager.swap_in(request)
            self._carry_out_transfers()
            request.status = RequestStatus.RUNNING

    @rule(which=st.integers(0, 2), rank=st.sampled_from([2, 4, 8]))
    def start_a_request_under_an_adapter(self, which, rank):
        adapters, lora = (
            self.manager.adapters,
            LoraRef(f"adapter-{which}-{rank}", "/nowhere", rank, ["q_proj", "down_proj"]),
        )
        if not adapters.can_start(lora) or adapters.blocks_to_start(lora) > self.manager.device_pool.num_available:
            return
        request_id = f"a{next(self.ids)}"
        adapters.acquire(request_id, lora)
        self._carry_out_transfers()
        self.adapter_users[request_id] = lora
        loads = adapters.take_loads()
        assert all(load.name == lora.name and len(load.pages) == adapters.pages_for(lora) for load in loads)

    @precondition(lambda self: self.adapter_users)
    @rule(data=st.data())
    def end_a_request_under_an_adapter(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.adapter_users)))
        self.manager.adapters.release(request_id, self.adapter_users.pop(request_id))

    @invariant()
    def adapter_pages_are_no_sequences_blocks_and_held_while_used(self):
        adapters = self.manager.adapters
        tables = {
            b for r in self.requests if r.status is RequestStatus.RUNNING for s in r.seqs for b in s.kv.block_table
        }
        for held in adapters.on_device.values():
            assert len(held.pages) == len(set(held.pages))
            if held.users:
                assert not set(held.pages) & tables
                assert all(self.manager.device_pool.ref_count(page) == 1 for page in held.pages)
        assert len(adapters.on_device) <= adapters.max_loras
        for lora in self.adapter_users.values():
            assert self.adapter_users and lora.name in adapters.on_device

    @invariant()
    def every_block_is_free_referenced_or_cached_in_every_tier(self):
        self.manager.audit(seq.kv for request in self.requests for seq in request.seqs)

    @invariant()
    def reference_counts_match_the_block_tables(self):
        manager = self.manager
        for pool, status in ((manager.device_pool, RequestStatus.RUNNING), (manager.swap_pool, RequestStatus.SWAPPED)):
            counts = dict(self.manager.adapters.held_pages()) if pool is self.manager.device_pool else {}
            for request in self.requests:
                if request.status is status:
                    for seq in request.seqs:
                        for block in seq.kv.block_table:
                            counts[block] = counts.get(block, 0) + 1
            for block in range(pool.num_blocks):
                assert pool.ref_count(block) == counts.get(block, 0)
                if counts.get(block):
                    assert not pool.is_evictable(block)

    @invariant()
    def freed_sequences_hold_nothing(self):
        assert all(seq.kv.block_table == [] for seq in self.freed)


class WriteThroughMachine(KVCacheMachine):
    """The same, with each block copied to the host cache as soon as it is cached on the device."""

    write_through = True


TestKVCacheManager = KVCacheMachine.TestCase
TestKVCacheManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheManagerWriteThrough = WriteThroughMachine.TestCase
TestKVCacheManagerWriteThrough.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
