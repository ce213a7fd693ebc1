"""Drive the scheduler without a worker: a stand-in that 'computes' steps like the real one."""

from __future__ import annotations

import itertools
import time
from collections import deque

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.policy import SchedulingPolicy
from services.scheduler.request import RequestStatus
from services.scheduler.reservation import Reservation
from services.scheduler.scheduler import Budgets, PreemptionPolicy, Scheduler
from services.scheduler.speculation import Speculation
from services.worker.ngram import NgramProposer
from shared.config import SpeculativeConfig
from shared.protocol import AddRequest, RequestOutput, SampledTokens, Step, StepResult
from shared.sampling import SamplingParams

EOS = 0


class StandInWorker:
    """Keeps each sequence's tokens as a worker would, and samples `next_token(seq_id, n)`.

    Like the real worker it forks a finished prompt into best_of samples, reports the top
    2 x width candidates of every beam, appends what it samples where the request lets it, and
    makes and verifies proposals: it keeps them while they equal what it samples at their
    positions, and gives the token after them. It proposes by prompt lookup (n from `ngram`),
    or with `draft_token(seq_id, n)` as its "draft model"; and it starts an entry planned while
    proposals were unsettled where its own copy of the sequence ends."""

    def __init__(
        self, next_token=lambda seq_id, position: 100 + position, draft_token=None, ngram=(1, 3), block_size: int = 0
    ):
        self.next_token = next_token
        self.block_size = block_size  # given: every position an entry computes must have its slot
        self.draft_token = draft_token
        self.ngram = NgramProposer(*ngram)
        self.lookups: dict = {}
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.prompts: dict[int, tuple[int, SamplingParams]] = {}
        self.steps: list[Step] = []
        self.verified: list[tuple[int, int]] = []  # (seq_id, proposals) of every sampled entry

    def run(self, step: Step) -> StepResult:
        self.steps.append(step)
        for fork in step.forks:
            self.tokens[fork.seq_id] = list(self.tokens[fork.parent_seq_id])
            self.tables[fork.seq_id] = list(self.tables[fork.parent_seq_id])
            self.prompts[fork.seq_id] = self.prompts[fork.parent_seq_id]
        for seq_id in step.finished_seq_ids + step.preempted_seq_ids:
            self.tokens.pop(seq_id, None)
            self.tables.pop(seq_id, None)
        for new in step.new_sequences:
            self.tokens[new.seq_id] = list(new.token_ids)
            self.tables[new.seq_id] = []
            self.prompts[new.seq_id] = (new.num_prompt_tokens, new.sampling)
        sampled = []
        for entry in step.scheduled:
            tokens = self.tokens[entry.seq_id]
            tokens.extend(entry.appended_token_ids)
            del self.tables[entry.seq_id][entry.table_start :]
            self.tables[entry.seq_id].extend(entry.block_ids)
            start = len(tokens) - 1 if entry.start_at_end else entry.start
            end = start + entry.num_tokens - entry.num_draft_tokens
            assert end <= len(tokens)
            assert not entry.num_draft_tokens or end == len(tokens), "proposals must follow the last token"
            if self.block_size:
                assert start + entry.num_tokens <= len(self.tables[entry.seq_id]) * self.block_size, "a slot for each"
            if end == len(tokens):
                proposals = self._propose(entry.seq_id, tokens, entry.num_draft_tokens)
                self.verified.append((entry.seq_id, len(proposals)))
                samples = self._sample(entry.seq_id, tokens, proposals)
                num_prompt, sampling = self.prompts[entry.seq_id]
                # The worker follows the scheduler's word, which must be the rule's
                assert entry.worker_keeps_samples == sampling.worker_keeps_samples(len(tokens) - num_prompt)
                if entry.worker_keeps_samples:
                    tokens.extend(samples[0].token_ids)
                sampled += samples
        return StepResult(step.step_id, sampled, 0.0, 0.0)

    def _propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        if not k:
            return []
        if self.draft_token is not None:
            return [self.draft_token(seq_id, len(tokens) + j) for j in range(k)]
        if self.lookups.get(seq_id, (None,))[0] is not tokens:  # a new copy (forked, or computed again)
            self.lookups[seq_id] = (tokens, self.ngram.new_index())
        return self.ngram.propose(tokens, self.lookups[seq_id][1], k)

    def _sample(self, seq_id: int, tokens: list[int], proposals: list[int]) -> list[SampledTokens]:
        num_prompt, sampling = self.prompts[seq_id]
        token = self.next_token(seq_id, len(tokens))
        if sampling.use_beam_search:
            width = 2 * sampling.num_samples
            # A function of the beam's tokens, as a model's would be, not of its id: which ids a
            # beam's forks get depends on what else ran, and must not change the result.
            ids = [(token + 7 * i) % 997 for i in range(width)]
            logprobs = [-0.1 * (i + 1) - 0.01 * (hash(tuple(tokens)) % 7) for i in range(width)]
            return [SampledTokens(seq_id, [ids[0]], [logprobs[0]], [ids], [logprobs])]
        forks = len(tokens) == num_prompt and sampling.num_samples > 1
        if forks:
            return [
                SampledTokens(seq_id, [self.next_token(seq_id + 1000 * i, len(tokens))], [-1.0], [], [])
                for i in range(sampling.num_samples)
            ]
        run = []
        for i in range(len(proposals) + 1):
            run.append(self.next_token(seq_id, len(tokens) + i))
            if i == len(proposals) or run[-1] != proposals[i]:
                break
        return [SampledTokens(seq_id, run, [-1.0] * len(run), [], [], len(proposals))]


def make_scheduler(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    max_tokens_per_step=64,
    context=256,
    num_cpu_blocks=0,
    preemption="recompute",
    prefix_caching=False,
    chunked=False,
    reservation="paged",
    watermark=0.0,
    speculative: SpeculativeConfig | None = None,
    policy: SchedulingPolicy | None = None,
    clock=time.monotonic,
    num_host_cache_blocks=0,
):
    manager = KVCacheManager(
        num_blocks,
        block_size,
        num_cpu_blocks,
        watermark=watermark,
        enable_prefix_caching=prefix_caching,
        num_host_cache_blocks=num_host_cache_blocks,
    )
    if not chunked:  # a recomputed request must fit one step
        context = min(context, max_tokens_per_step)
    budgets = Budgets(max_num_seqs, max_tokens_per_step, context, chunked_prefill=chunked)
    speculation = Speculation(speculative, context) if speculative is not None else None
    return Scheduler(
        manager,
        budgets,
        [EOS],
        PreemptionPolicy(preemption),
        vocab_size=1000,
        reservation=Reservation(reservation),
        speculation=speculation,
        policy=policy,
        clock=clock,
    )


_ids = itertools.count()


def request(prompt_len=5, max_tokens=4, arrival=None, priority=0, tenant="", **sampling) -> AddRequest:
    n = next(_ids)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return AddRequest(
        f"req-{n}",
        list(range(1, prompt_len + 1)),
        params,
        float(arrival if arrival is not None else n),
        priority=priority,
        tenant=tenant,
    )


def check_block_accounting(scheduler: Scheduler) -> None:
    """In every tier each block is free, referenced or cached, reference counts match the block tables,
    and a request's blocks are in host memory exactly while it is swapped out."""
    scheduler.kv_cache.audit(seq.kv for seq in scheduler.sequences.values())
    for request in scheduler.requests.values():
        for seq in request.seqs:
            assert seq.kv.swapped == (request.status is RequestStatus.SWAPPED), (request, seq.kv.block_table)


class Pipeline:
    """Steps as the scheduler server runs them: up to `depth` planned ahead of the worker."""

    def __init__(self, scheduler: Scheduler, worker: StandInWorker, depth: int = 1):
        self.scheduler, self.worker, self.depth = scheduler, worker, depth
        self.in_flight: deque[Step] = deque()

    def fill(self) -> None:
        scheduler = self.scheduler
        while len(self.in_flight) < self.depth and scheduler.has_work():
            if self.in_flight and scheduler.needs_drain:
                return
            step = scheduler.schedule()
            if step is None:
                return
            self.in_flight.append(step)

    def advance(self) -> list[RequestOutput]:
        """Run the oldest step in flight and apply its result."""
        return self.scheduler.update(self.worker.run(self.in_flight.popleft()))


def run_to_completion(scheduler: Scheduler, worker: StandInWorker, max_steps=10_000, depth=1) -> dict[str, list]:
    """Step until idle; returns each request's outputs in order."""
    outputs: dict[str, list] = {}
    pipeline = Pipeline(scheduler, worker, depth)
    for _ in range(max_steps):
        pipeline.fill()
        if not pipeline.in_flight:
            break
        for output in pipeline.advance():
            outputs.setdefault(output.request_id, []).append(output)
        check_block_accounting(scheduler)
    return outputs
