"""Every request and sequence the scheduler holds, and the one place their tokens change.

The policy, the step builder, the result processor and beam search all go through this registry to
create, fork, extend, roll back and end sequences, and to learn what the workers must be told:
which sequences they lack, which tokens their copies miss, and which copies to fork or drop.
"""

from __future__ import annotations

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, Sequence
from services.scheduler.stopping import StopRule
from shared.protocol import Fork, NewSequence, ScheduledSequence


class SequenceRegistry:
    def __init__(self, kv_cache: KVCacheManager, stop: StopRule):
        self.kv_cache = kv_cache
        self.stop = stop
        self.requests: dict[str, Request] = {}
        self.sequences: dict[int, Sequence] = {}
        self._forks: list[Fork] = []  # for the workers, with the next step
        self._dropped: list[int] = []
        self._preempted: list[int] = []
        self._next_seq_id = 0

    # --- lifetime ------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.new_sequence(request, index=0)

    def new_sequence(self, request: Request, index: int, output_token_ids: list[int] | None = None) -> Sequence:
        seq = Sequence(self._next_seq_id, request, index, output_token_ids)
        self._next_seq_id += 1
        self.sequences[seq.seq_id] = seq
        request.seqs.append(seq)
        return seq

    def fork(self, parent: Sequence, index: int) -> Sequence:
        """A new sequence of the parent's request with its tokens and its blocks, shared."""
        parent.request.forked = True
        child = self.new_sequence(parent.request, index, list(parent.output_token_ids))
        child.output_logprobs = list(parent.output_logprobs)
        child.output_top_logprobs = list(parent.output_top_logprobs)
        child.cumulative_logprob = parent.cumulative_logprob
        self.kv_cache.fork(parent, child)
        child.flight.forked_from(parent.flight)
        if parent.num_tokens_known_to_worker:
            self._forks.append(Fork(child.seq_id, parent.seq_id, index))
        return child

    def finish_sequence(self, seq: Sequence, reason: str) -> None:
        """End a sequence and free its blocks (a request that sends its KV to another engine holds its prompt's)."""
        self.kv_cache.connectors.finished(seq, reason)
        self.kv_cache.free(seq)
        if seq.num_tokens_known_to_worker:
            self._dropped.append(seq.seq_id)
        seq.finish_reason = reason
        seq.request.seqs.remove(seq)
        if not seq.request.sampling.use_beam_search:  # beams' results live in their BeamSearch
            seq.request.finished_seqs.append(seq)
        del self.sequences[seq.seq_id]

    def release(self, request: Request) -> None:
        """End every live sequence of the request and forget it; leaving its queue is the policy's part."""
        for seq in list(request.seqs):
            self.finish_sequence(seq, seq.finish_reason or "abort")
        self.requests.pop(request.request_id, None)

    def preempt_by_recompute(self, seq: Sequence) -> None:
        """Its blocks go and the workers drop their copy: everything is computed again."""
        self.kv_cache.reset(seq)
        if seq.num_tokens_known_to_worker:
            self._preempted.append(seq.seq_id)
        seq.flight.forget_worker_copy()

    # --- tokens --------------------------------------------------------------------------

    def append(
        self, seq: Sequence, token_ids: list[int], logprobs: list[float], tops: list[dict[int, float]]
    ) -> tuple[int, str | None]:
        """Append a run of sampled tokens up to the first that ends the sequence; returns how many
        were kept and why the sequence ends (None while it goes on). The rest of the run is dropped."""
        sampling = seq.request.sampling
        kept_by_worker = sampling.worker_keeps_samples(len(seq.output_token_ids))
        kept, reason = 0, None
        for token_id, logprob, top in zip(token_ids, logprobs, tops):
            seq.output_token_ids.append(token_id)
            seq.output_logprobs.append(logprob)
            seq.output_top_logprobs.append(top)
            seq.cumulative_logprob += logprob
            kept += 1
            reason = self.stop.reason(sampling, token_id, len(seq.output_token_ids), seq.num_tokens)
            if reason is not None:
                break
        if kept_by_worker:
            seq.flight.kept_by_worker(kept)
        return kept, reason

    def settle_proposals(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A step verified `num_proposed` proposals of the sequence and kept `num_accepted`: the
        positions of the rejected ones count as not computed, and the blocks only they had taken go
        back to the pool, before any block is hashed, copied or swapped. A step planned after it
        that is still in flight keeps what it needs: the worker starts it where this one ended."""
        rejected = num_proposed - num_accepted
        seq.flight.settled(num_proposed)
        if rejected > 0:
            self.kv_cache.take_back(seq, rejected)

    # --- what the workers must be told ---------------------------------------------------

    def step_entry(self, seq: Sequence, num_tokens: int) -> tuple[NewSequence | None, ScheduledSequence]:
        """The sequence's share of the next step: the sequence itself if the workers lack it, the
        tokens their copy misses, the blocks new to them, and its draft tokens (which the entry
        takes: they are in flight from here on)."""
        known, num_prompt = seq.num_tokens_known_to_worker, seq.num_prompt_tokens
        new = None
        if known == 0:
            lora = seq.request.lora
            new = NewSequence(
                seq.seq_id,
                seq.token_ids(),
                num_prompt,
                seq.request.sampling,
                seq.index,
                lora.key if lora is not None else "",
            )
            appended: list[int] = []
        else:
            appended = seq.output_token_ids[known - num_prompt :]
        table_start, blocks = self.kv_cache.unsynced_blocks(seq, worker_has_table=known > 0)
        # Where the proposals of a step in flight are not settled yet, neither is this entry's start.
        keeps = seq.request.sampling.worker_keeps_samples(len(seq.output_token_ids))
        unsettled = seq.num_speculative > 0
        drafts = seq.flight.sent(num_prompt + len(seq.output_token_ids))
        entry = ScheduledSequence(
            seq.seq_id,
            seq.kv.num_computed,
            num_tokens,
            appended,
            table_start,
            blocks,
            drafts,
            start_at_end=unsettled,
            worker_keeps_samples=keeps,
        )
        return new, entry

    def take_worker_notices(self) -> tuple[list[Fork], list[int], list[int]]:
        """Forks, drops and recompute preemptions the workers have not heard of yet."""
        forks = [
            f
            for f in self._forks
            if (child := self.sequences.get(f.seq_id)) is not None and child.num_tokens_known_to_worker
        ]
        notices = (forks, self._dropped, self._preempted)
        self._forks, self._dropped, self._preempted = [], [], []
        return notices
