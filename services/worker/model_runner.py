"""Execute one `Step`: update the per-sequence mirrors, run the model over the flattened batch,
and sample for every sequence whose tokens are now all computed.

A sequence with proposals runs them as a short prefill after its last token, and every one of
those positions is sampled as it would be without them (the same logits processing, the same
seeded draw for the same position). The proposals are kept while they equal what is sampled at
their positions, and the first sample that differs, or the one after the last proposal, ends
the run. For proposals that are single tokens (n-gram lookups, greedy drafts) this is the
rejection sampling of Leviathan et al. and Chen et al. (2023): a proposal x survives with the
target's probability p(x), and a rejected position yields a draw from p without x, renormalized.
So every emitted token has the target model's distribution, and a seeded request gives the same
tokens with speculation as without.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from kernels.batch import PagedBatch
from services.worker.block_tables import BlockTables
from services.worker.cpu_threads import ComputeThreads
from services.worker.decode_graphs import DecodeGraphs
from services.worker.drafter import Drafter
from services.worker.grammar import GrammarEngine, GrammarState
from services.worker.kv_cache import KVCache
from services.worker.lora import LoraAdapters
from services.worker.mirrors import (
    SequenceFault,
    SequenceMirror,
    StepError,
    accepted_run,
    rows_by_adapter,
    rows_to_sample,
)
from services.worker.ngram import NgramProposer, look_up_proposals
from services.worker.pooling import Pooler
from services.worker.rows_read import hidden_rows, read_tensor, rows_read
from services.worker.sampler import Sampler, SampleRow, prompt_logprobs_of
from services.worker.step_inputs import StepInputs
from shared.prefix_keys import KEY_BYTES
from shared.protocol import (
    DEVICE,
    DISK,
    HOST,
    NewSequence,
    SampledTokens,
    ScheduledSequence,
    Step,
    StepResult,
)

if TYPE_CHECKING:
    from services.worker.models.base import PagedCausalLM


# (from tier, to tier) of the transfers a worker carries out; a block on disk is one of 0 (its file's key names it)
_TRANSFERS = {(DEVICE, DEVICE), (DEVICE, HOST), (HOST, DEVICE), (DEVICE, DISK), (DISK, HOST)}


class ModelRunner:
    def __init__(
        self,
        model: PagedCausalLM,
        cache: KVCache,
        device: torch.device,
        seed: int,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] = (),
        drafter: Drafter | None = None,
        threads: ComputeThreads | None = None,
        grammars: GrammarEngine | None = None,
        ngram: NgramProposer | None = None,
        graphs: DecodeGraphs | None = None,
        adapters: LoraAdapters | None = None,
        pooler: Pooler | None = None,
    ) -> None:
        self.model = model
        self.pooler = pooler  # --runner pooling: prompts become vectors, not tokens
        self.adapters = adapters  # with --enable-lora: the adapters loaded into pages of the KV cache
        self.cache = cache
        self.device = device
        self.sampler = Sampler(seed, frozenset(eos_token_ids))
        self.vocab_size = vocab_size or model.lm_head.weight.shape[0]
        self.mirrors: dict[int, SequenceMirror] = {}
        self.tables = BlockTables(device)
        self.inputs = StepInputs(device)  # the step's token ids, positions, rows and offsets
        self.drafter = drafter  # a draft model with its own KV cache under the same block ids
        self.ngram = ngram  # or prompt lookup: either fills the draft tokens a step asks for
        self.caches = [cache] + ([drafter.cache] if drafter is not None else [])
        self.threads = threads  # on a CPU: each step's share of the cores
        self.grammars = grammars  # None: requests with a grammar are refused
        self.mask_thread: ThreadPoolExecutor | None = None
        self.graphs = graphs  # decode steps on CUDA graphs; None: every step eagerly

    @torch.inference_mode()
    def execute(self, step: Step) -> StepResult:
        started = time.perf_counter()
        failures: dict[int, str] = {}
        for fork in step.forks:
            parent = self.mirrors.get(fork.parent_seq_id)
            if parent is None:
                failures[fork.seq_id] = f"forks unknown sequence {fork.parent_seq_id}"
                continue
            self._drop(fork.seq_id)
            row = self.tables.claim()
            self.tables.copy_row(parent.row, row)
            self.mirrors[fork.seq_id] = parent.copy(fork.index, row)
        for seq_id in step.finished_seq_ids + step.preempted_seq_ids:
            self._drop(seq_id)
        for new in step.new_sequences:
            problem = self._refusal(new, step)
            grammar: GrammarState | None = None
            if problem is None and new.sampling.grammar:
                matcher = (
                    self.grammars.start(new.sampling.grammar)
                    if self.grammars
                    else ("structured outputs need the model's tokenizer in the worker")
                )
                if isinstance(matcher, str):
                    problem = matcher
                else:
                    grammar = matcher
            if problem is None:
                self._drop(new.seq_id)
                self.mirrors[new.seq_id] = SequenceMirror(
                    list(new.token_ids),
                    new.num_prompt_tokens,
                    new.sampling,
                    new.index,
                    self.tables.claim(),
                    grammar=grammar,
                    lora=new.lora,
                )
            else:
                failures[new.seq_id] = problem
        self._check_transfers(step)
        transfers_started = time.perf_counter()
        for cache in self.caches:
            cache.finish_swaps()
            cache.transfer(step.transfers)
        self.cache.exchange(step)
        for load in step.lora_loads:  # into blocks the transfers above may have written back first
            assert self.adapters is not None  # _check_transfers refused loads without adapters
            try:
                self.adapters.load(load)
            except Exception as exc:  # its files changed or lie: the requests under it fail, not the step's others
                key = load.key or load.name
                users = [seq_id for seq_id, mirror in self.mirrors.items() if mirror.lora == key]
                raise SequenceFault(f"adapter {load.name!r} could not be loaded: {exc}", users) from exc
        transfer_ms = (time.perf_counter() - transfers_started) * 1e3
        scheduled = [resolved for entry in step.scheduled if (resolved := self._accepts(entry, failures)) is not None]
        if not scheduled:  # nothing to compute: perhaps a step to hear of reads from disk or fetches
            landed = self.cache.collect(wait=True)
            return StepResult(
                step.step_id,
                [],
                0.0,
                0.0,
                failures=failures,
                transfer_ms=transfer_ms,
                reads=landed.reads,
                failed_reads=landed.failed_reads,
                loaded=landed.loaded,
                failed_loads=landed.failed_loads,
            )

        input_ids: list[int] = []
        positions: list[int] = []
        starts, context_lens, rows = [0], [], []
        to_sample: list[int] = []
        pooled_entries: list[int] = []  # pooling requests' prompt chunks
        prompt_logprob_entries: list[int] = []  # of entries whose prompt tokens' logprobs are wanted
        # seq_id -> what its positions after its last token hold (a draft model's: once drafted)
        proposals = look_up_proposals(scheduled, self.mirrors, self.ngram) if self.ngram is not None else {}
        for i, entry in enumerate(scheduled):
            mirror = self.mirrors[entry.seq_id]
            end = entry.start + entry.num_tokens
            known_end = end - entry.num_draft_tokens
            if mirror.sampling.prompt_logprobs is not None and entry.start < mirror.num_prompt_tokens - 1:
                prompt_logprob_entries.append(i)
            input_ids.extend(mirror.token_ids[entry.start : known_end])
            input_ids.extend(proposals.get(entry.seq_id, [0] * entry.num_draft_tokens))
            positions.extend(range(entry.start, end))
            starts.append(starts[-1] + entry.num_tokens)
            context_lens.append(end)
            rows.append(mirror.row)
            if mirror.sampling.pooling:
                pooled_entries.append(i)
            elif known_end == len(mirror.token_ids):
                to_sample.append(i)

        if self.threads is not None:
            self.threads.use(self.threads.for_step(len(input_ids)))
        if self.drafter is not None:
            drafted = self.drafter.draft(scheduled, self.mirrors, self.tables)
            for i, entry in enumerate(scheduled):
                if entry.num_draft_tokens:
                    proposals[entry.seq_id] = drafted[entry.seq_id]
                    input_ids[starts[i + 1] - entry.num_draft_tokens : starts[i + 1]] = drafted[entry.seq_id]
        # The grammars' masks depend on no logits: on a GPU they are computed while the model runs.
        masks = self._start_grammar_masks(
            [(self.mirrors[scheduled[i].seq_id], proposals.get(scheduled[i].seq_id, [])) for i in to_sample]
        )
        # Every sampled entry's last position, and before it its proposals' positions.
        logit_rows = [
            row for i in to_sample for row in range(starts[i + 1] - 1 - scheduled[i].num_draft_tokens, starts[i + 1])
        ]
        inputs = self.tables.step(
            self.inputs, input_ids, positions, rows, starts, context_lens, logit_rows, self.cache.block_size
        )
        if self.adapters is not None:
            inputs.batch.adapters = self.adapters.batch(rows_by_adapter(scheduled, starts, self.mirrors))
        # Where the step reads only some rows' final hidden states (sampled, pooled), the last layer gives theirs.
        plain, pooler = inputs.batch.adapters is None, self.pooler
        chunks = [(scheduled[i], starts[i], self.mirrors[scheduled[i].seq_id]) for i in pooled_entries]
        reads = [pooler.rows_read(m, e, first) for e, first, m in chunks] if pooler is not None else []
        keeps = self.model.keeps_rows and plain and not prompt_logprob_entries  # prompt logprobs read every row
        read = rows_read(logit_rows, reads, len(input_ids)) if keeps else None
        if self.graphs is not None and plain and self.graphs.covers(len(input_ids), context_lens):
            hidden, read = self.graphs.run(inputs), None
        else:
            kept = [] if read is None else [read_tensor(read, logit_rows, inputs.logit_rows, self.device)]
            hidden = self.model(inputs.input_ids, inputs.positions, self.cache.layers, inputs.batch, *kept)
        logits = self.model.logits(hidden_rows(hidden, read, logit_rows, inputs.logit_rows)) if logit_rows else None
        pooled = pooler.outputs(chunks, reads, lambda rows: hidden_rows(hidden, read, rows)) if pooler else []
        prompt_logprobs = [
            prompt_logprobs_of(self.model, self.mirrors[scheduled[i].seq_id], scheduled[i], starts[i], hidden)
            for i in prompt_logprob_entries
        ]
        sampled_at = time.perf_counter()

        sample_rows = [
            row
            for i in to_sample
            for row in rows_to_sample(self.mirrors[scheduled[i].seq_id], proposals.get(scheduled[i].seq_id, []))
        ]
        if masks is not None:
            self._add_grammar_masks(sample_rows, *masks)
        samples = iter(self.sampler(logits, sample_rows) if sample_rows else [])
        sampled = []
        for i in to_sample:
            seq_id = scheduled[i].seq_id
            mirror = self.mirrors[seq_id]
            verified = proposals.get(seq_id, [])
            run = [next(samples) for _ in range(len(verified) + 1)]
            if len(run[0]) > 1:  # a finished prompt forks into best_of samples: one token each
                sampled += [
                    SampledTokens(seq_id, [s.token_id], [s.logprob], [s.top_ids], [s.top_logprobs]) for s in run[0]
                ]
                continue
            kept = accepted_run([row[0] for row in run], verified)
            sampled.append(
                SampledTokens(
                    seq_id,
                    [s.token_id for s in kept],
                    [s.logprob for s in kept],
                    [s.top_ids for s in kept] if kept[0].top_ids else [],
                    [s.top_logprobs for s in kept] if kept[0].top_ids else [],
                    len(verified),
                )
            )
            generated = len(mirror.token_ids) - mirror.num_prompt_tokens
            if scheduled[i].worker_keeps_samples:
                # Its next tokens are known here first: the scheduler may already have planned the next.
                mirror.token_ids.extend(s.token_id for s in kept)
            if self.drafter is not None and verified:
                self.drafter.settle(mirror, mirror.num_prompt_tokens + generated, len(kept) - 1)
        done = time.perf_counter()
        transfers = self.cache.collect()
        return StepResult(
            step.step_id,
            sampled,
            (sampled_at - started) * 1e3,
            (done - sampled_at) * 1e3,
            failures=failures,
            prompt_logprobs=prompt_logprobs,
            reads=transfers.reads,
            failed_reads=transfers.failed_reads,
            transfer_ms=transfer_ms,
            loaded=transfers.loaded,
            failed_loads=transfers.failed_loads,
            pooled=[output for output in pooled if output is not None],
        )

    # --- checks: a bad sequence is refused alone; a bad block operation fails the step ----

    def _refusal(self, new: NewSequence, step: Step) -> str | None:
        if not all(0 <= t < self.vocab_size for t in new.token_ids):
            return "a token id outside the vocabulary"
        if not 0 < new.num_prompt_tokens <= len(new.token_ids):
            return "a prompt length that does not match its tokens"
        if new.lora and (
            self.adapters is None
            or (
                new.lora not in self.adapters.loaded
                and all((load.key or load.name) != new.lora for load in step.lora_loads)
            )
        ):
            return f"adapter {new.lora!r} is not loaded"
        if self.pooler is not None:
            return self.pooler.refusal(new.sampling.pooling)
        if new.sampling.pooling:
            return "this model generates; pooling requests need a worker started with --runner pooling"
        return None  # its sampling parameters: the scheduler checked them (docs/design/checks.md)

    def _accepts(self, entry: ScheduledSequence, failures: dict[int, str]) -> ScheduledSequence | None:
        """Apply the entry's differences to its mirror and return the entry as this step computes it
        (an entry planned before the scheduler knew how many proposals a step kept starts at the
        mirror's last token), or refuse the sequence."""
        mirror = self.mirrors.get(entry.seq_id)
        if mirror is None:
            failures.setdefault(entry.seq_id, "unknown sequence")
            return None
        problem = None
        if not all(0 <= t < self.vocab_size for t in entry.appended_token_ids):
            problem = "a token id outside the vocabulary"
        elif not all(0 <= b < self.cache.num_blocks for b in entry.block_ids):
            problem = f"a block id outside [0, {self.cache.num_blocks})"
        elif (
            not 0 <= entry.table_start <= mirror.num_blocks
            or entry.start < 0
            or entry.num_draft_tokens < 0
            or entry.num_tokens <= entry.num_draft_tokens
        ):
            problem = "an inconsistent step entry"
        elif entry.num_draft_tokens and self.drafter is None and self.ngram is None:
            problem = "draft tokens asked of a worker that drafts none (start it with --speculative-config)"
        if problem is None:
            mirror.token_ids.extend(entry.appended_token_ids)
            if entry.start_at_end:
                entry = dataclasses.replace(entry, start=len(mirror.token_ids) - 1, start_at_end=False)
            self.tables.write(mirror.row, entry.table_start, entry.block_ids)
            mirror.num_blocks = entry.table_start + len(entry.block_ids)
            end = entry.start + entry.num_tokens
            known_end = end - entry.num_draft_tokens
            if known_end > len(mirror.token_ids) or end > mirror.num_blocks * self.cache.block_size:
                problem = f"tokens or blocks missing for position {end}"
            elif entry.num_draft_tokens and known_end != len(mirror.token_ids):
                problem = "proposals that do not follow the sequence's last token"
        if problem is not None:
            failures[entry.seq_id] = problem
            self._drop(entry.seq_id)
            return None
        return entry

    def _drop(self, seq_id: int) -> None:
        mirror = self.mirrors.pop(seq_id, None)
        if mirror is not None:
            self.tables.release(mirror.row)

    def _check_transfers(self, step: Step) -> None:
        blocks = {DEVICE: self.cache.num_blocks, HOST: self.cache.num_cpu_blocks, DISK: 1}
        for t in step.transfers:
            if (t.src_tier, t.dst_tier) not in _TRANSFERS:
                raise StepError(f"step {step.step_id}: no transfer goes from tier {t.src_tier} to tier {t.dst_tier}")
            if not (0 <= t.src_block < blocks[t.src_tier] and 0 <= t.dst_block < blocks[t.dst_tier]):
                raise StepError(f"step {step.step_id}: transfer {t} is out of range")
            if DISK in (t.src_tier, t.dst_tier) and len(t.key) != KEY_BYTES:
                raise StepError(f"step {step.step_id}: a transfer to or from disk without a prefix-cache key")
        for load in step.lora_loads:
            if self.adapters is None:
                raise StepError(f"step {step.step_id}: an adapter to load, on a worker without --enable-lora")
            if not all(0 <= page < self.cache.num_blocks for page in load.pages):
                raise StepError(f"step {step.step_id}: adapter {load.name!r} has pages out of range")

    @torch.inference_mode()
    def measure_prefill_rate(self, num_tokens: int = 256) -> float:
        """Prompt tokens per second of one forward pass, on scratch blocks, before serving."""
        block_size = self.cache.block_size
        num_tokens = min(num_tokens, self.cache.num_blocks * block_size)
        num_blocks = -(-num_tokens // block_size)
        batch = PagedBatch.build(
            list(range(num_tokens)), [list(range(num_blocks))], [0, num_tokens], [num_tokens], self.device
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        self.model(ids, positions, self.cache.layers, batch)  # warm up
        self._sync()
        started = time.perf_counter()
        self.model(ids, positions, self.cache.layers, batch)
        self._sync()
        return num_tokens / max(time.perf_counter() - started, 1e-9)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _start_grammar_masks(
        self, sequences: list[tuple[SequenceMirror, list[int]]]
    ) -> tuple[list[int], list[int], Future[Any]] | None:
        """For the sequences that sample this step (in order, each with its proposals): None if none
        has a grammar, else where their sample rows start and the masks being computed."""
        constrained, firsts, first = [], [], 0
        for mirror, verified in sequences:
            if mirror.grammar is not None:
                constrained.append((mirror.grammar, mirror.token_ids, mirror.num_prompt_tokens, verified))
                firsts.append(first)
            first += len(verified) + 1
        if not constrained:
            return None
        counts = [len(verified) + 1 for *_, verified in constrained]
        grammars = self.grammars
        assert grammars is not None  # constrained sequences have their grammar started by it
        if not self._masks_beside_forward():
            done: Future[torch.Tensor] = Future()
            done.set_result(grammars.masks(constrained))
            return firsts, counts, done
        if self.mask_thread is None:
            self.mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return firsts, counts, self.mask_thread.submit(grammars.masks, constrained)

    def _masks_beside_forward(self) -> bool:
        """Whether a step's masks are computed in a thread while the model runs: on a GPU, whose
        host is idle then, and on a CPU where the step's threads leave a core, which the masks then
        use (on the shipped model at concurrency 32, 1 ms of a 16 ms step moves off the step). Where
        the step takes every core, a mask thread would take one from it, and its threads stall at
        every barrier while it runs."""
        return self.device.type == "cuda" or (self.threads is not None and self.threads.leaves_a_core())

    @staticmethod
    def _add_grammar_masks(
        rows: list[SampleRow], firsts: list[int], counts: list[int], computing: Future[torch.Tensor]
    ) -> None:
        """Give each constrained sequence's rows (its last position, then each proposal's) their masks."""
        masks, at = computing.result(), 0
        for first, count in zip(firsts, counts):
            for j in range(count):
                rows[first + j].allowed = masks[at + j]
            at += count

    def reset(self) -> None:
        """Forget every sequence, and the transfers in flight: after a failed step the scheduler computes
        every request again."""
        self.cache.forget_transfers()
        self.mirrors.clear()
        self.tables.reset()
