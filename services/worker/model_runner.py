"""Execute one `Step`: update the per-sequence mirrors, run the model over the flattened batch,
and sample a token for every sequence whose tokens are now all computed."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels.batch import PagedBatch
from services.worker.block_tables import BlockTables
from services.worker.kv_cache import KVCache
from services.worker.sampler import Sampler, SampleRow
from shared.protocol import PromptLogprobs, NewSequence, SampledToken, ScheduledSequence, Step, StepResult
from shared.sampling import InvalidParameter, SamplingParams


@dataclass(slots=True)
class SequenceMirror:
    """The worker's copy of a sequence, kept between steps so steps carry only differences."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    index: int
    row: int  # its block table is this row of the runner's BlockTables
    num_blocks: int = 0  # entries of that row in use

    def copy(self, index: int, row: int) -> SequenceMirror:
        return SequenceMirror(list(self.token_ids), self.num_prompt_tokens, self.sampling, index, row,
                              self.num_blocks)


class StepError(RuntimeError):
    pass


class ModelRunner:
    def __init__(self, model, cache: KVCache, device: torch.device, seed: int, vocab_size: int | None = None,
                 eos_token_ids: list[int] = ()):
        self.model = model
        self.cache = cache
        self.device = device
        self.sampler = Sampler(seed, frozenset(eos_token_ids))
        self.vocab_size = vocab_size or model.lm_head.weight.shape[0]
        self.mirrors: dict[int, SequenceMirror] = {}
        self.tables = BlockTables(device)

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
            problem = self._refusal(new)
            if problem is None:
                self._drop(new.seq_id)
                self.mirrors[new.seq_id] = SequenceMirror(list(new.token_ids), new.num_prompt_tokens, new.sampling,
                                                          new.index, self.tables.claim())
            else:
                failures[new.seq_id] = problem
        self._check_block_pairs(step)
        self.cache.finish_swaps()
        self.cache.swap_out(step.swap_out)
        self.cache.swap_in(step.swap_in)
        self.cache.copy_blocks(step.copies)
        scheduled = [entry for entry in step.scheduled if self._accepts(entry, failures)]
        if not scheduled:
            return StepResult(step.step_id, [], 0.0, 0.0, failures=failures)

        input_ids, positions, starts, context_lens, rows = [], [], [0], [], []
        to_sample: list[int] = []
        prompt_logprob_entries: list[int] = []  # of entries whose prompt tokens' logprobs are wanted
        for entry in scheduled:
            mirror = self.mirrors[entry.seq_id]
            end = entry.start + entry.num_tokens
            if mirror.sampling.prompt_logprobs is not None and entry.start < mirror.num_prompt_tokens - 1:
                prompt_logprob_entries.append(len(starts) - 1)
            input_ids.extend(mirror.token_ids[entry.start : end])
            positions.extend(range(entry.start, end))
            starts.append(starts[-1] + entry.num_tokens)
            context_lens.append(end)
            rows.append(mirror.row)
            if end == len(mirror.token_ids):
                to_sample.append(len(starts) - 2)

        position_tensor = torch.tensor(positions, dtype=torch.int64, device=self.device)
        batch = self._batch(rows, position_tensor, starts, context_lens)
        input_tensor = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        hidden = self.model(input_tensor, position_tensor, self.cache.layers, batch)
        last_rows = torch.tensor([starts[i + 1] - 1 for i in to_sample], dtype=torch.int64, device=self.device)
        logits = self.model.logits(hidden[last_rows])
        prompt_logprobs = [self._prompt_logprobs(scheduled[i], starts[i], hidden) for i in prompt_logprob_entries]
        sampled_at = time.perf_counter()

        rows = [self._sample_row(self.mirrors[scheduled[i].seq_id]) for i in to_sample]
        samples = self.sampler(logits, rows) if rows else []
        sampled = []
        for i, row, row_samples in zip(to_sample, rows, samples):
            seq_id = scheduled[i].seq_id
            sampled += [SampledToken(seq_id, s.token_id, s.logprob, s.top_ids, s.top_logprobs) for s in row_samples]
            if row.num_samples == 1 and not row.params.use_beam_search:
                # Its next token is known here first: the scheduler may already have planned it.
                self.mirrors[seq_id].token_ids.append(row_samples[0].token_id)
        done = time.perf_counter()
        return StepResult(
            step.step_id, sampled, (sampled_at - started) * 1e3, (done - sampled_at) * 1e3, failures=failures,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_logprobs(self, entry, first_row: int, hidden: torch.Tensor) -> PromptLogprobs:
        """How likely each prompt token this step computed for `entry` was (its hidden rows start at `first_row`)."""
        mirror = self.mirrors[entry.seq_id]
        wanted = mirror.sampling.prompt_logprobs
        last = min(entry.start + entry.num_tokens, mirror.num_prompt_tokens - 1)  # positions predicting a prompt token
        rows = torch.arange(first_row, first_row + last - entry.start, device=self.device)
        logprobs = torch.log_softmax(self.model.logits(hidden[rows]).float(), dim=-1)
        targets = torch.tensor(mirror.token_ids[entry.start + 1 : last + 1], device=self.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        top_values, top_ids = logprobs.topk(wanted, dim=-1) if wanted else (logprobs[:, :0], logprobs[:, :0].long())
        return PromptLogprobs(entry.seq_id, entry.start + 1, chosen, top_ids.tolist(), top_values.tolist())

    # --- checks: a bad sequence is refused alone; a bad block operation fails the step ----

    def _refusal(self, new: NewSequence) -> str | None:
        if not all(0 <= t < self.vocab_size for t in new.token_ids):
            return "a token id outside the vocabulary"
        if not 0 < new.num_prompt_tokens <= len(new.token_ids):
            return "a prompt length that does not match its tokens"
        try:
            new.sampling.validate(self.vocab_size)
        except InvalidParameter as exc:
            return f"{exc.param}: {exc}"
        return None

    def _accepts(self, entry: ScheduledSequence, failures: dict[int, str]) -> bool:
        """Apply the entry's differences to its mirror, or refuse the sequence."""
        mirror = self.mirrors.get(entry.seq_id)
        if mirror is None:
            failures.setdefault(entry.seq_id, "unknown sequence")
            return False
        problem = None
        if not all(0 <= t < self.vocab_size for t in entry.appended_token_ids):
            problem = "a token id outside the vocabulary"
        elif not all(0 <= b < self.cache.num_blocks for b in entry.block_ids):
            problem = f"a block id outside [0, {self.cache.num_blocks})"
        elif not 0 <= entry.table_start <= mirror.num_blocks or entry.start < 0 or entry.num_tokens < 1:
            problem = "an inconsistent step entry"
        if problem is None:
            mirror.token_ids.extend(entry.appended_token_ids)
            self.tables.write(mirror.row, entry.table_start, entry.block_ids)
            mirror.num_blocks = entry.table_start + len(entry.block_ids)
            end = entry.start + entry.num_tokens
            if end > len(mirror.token_ids) or end > mirror.num_blocks * self.cache.block_size:
                problem = f"tokens or blocks missing for position {end}"
        if problem is not None:
            failures[entry.seq_id] = problem
            self._drop(entry.seq_id)
            return False
        return True

    def _batch(self, rows: list[int], positions: torch.Tensor, starts: list[int], context_lens: list[int]) -> PagedBatch:
        """The kernels' view of the step, gathered from the persistent block tables."""
        device, block_size = self.device, self.cache.block_size
        row_index = torch.tensor(rows, dtype=torch.int64, device=device)
        query_lens = torch.tensor([b - a for a, b in zip(starts, starts[1:])], dtype=torch.int64, device=device)
        slot_mapping = self.tables.slot_mapping(row_index.repeat_interleave(query_lens), positions, block_size)
        return PagedBatch(
            slot_mapping=slot_mapping,
            block_tables=self.tables.gather(row_index, -(-max(context_lens) // block_size)),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            query_start_list=starts,
            context_lens_list=context_lens,
        )

    def _drop(self, seq_id: int) -> None:
        mirror = self.mirrors.pop(seq_id, None)
        if mirror is not None:
            self.tables.release(mirror.row)

    def _check_block_pairs(self, step: Step) -> None:
        gpu, cpu = self.cache.num_blocks, self.cache.num_cpu_blocks
        for name, pairs, (first, second) in (("swap_out", step.swap_out, (gpu, cpu)),
                                             ("swap_in", step.swap_in, (cpu, gpu)),
                                             ("copies", step.copies, (gpu, gpu))):
            for a, b in pairs:
                if not (0 <= a < first and 0 <= b < second):
                    raise StepError(f"step {step.step_id}: {name} pair ({a}, {b}) is out of range")

    @torch.inference_mode()
    def measure_prefill_rate(self, num_tokens: int = 256) -> float:
        """Prompt tokens per second of one forward pass, on scratch blocks, before serving."""
        block_size = self.cache.block_size
        num_tokens = min(num_tokens, self.cache.num_blocks * block_size)
        num_blocks = -(-num_tokens // block_size)
        batch = PagedBatch.build(list(range(num_tokens)), [list(range(num_blocks))], [0, num_tokens],
                                 [num_tokens], self.device)
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

    @staticmethod
    def _sample_row(mirror: SequenceMirror) -> SampleRow:
        generated = len(mirror.token_ids) - mirror.num_prompt_tokens
        sampling = mirror.sampling
        forks = generated == 0 and not sampling.use_beam_search and sampling.num_samples > 1
        return SampleRow(sampling, generated, mirror.index, sampling.num_samples if forks else 1, mirror.token_ids,
                         mirror.num_prompt_tokens)

    def reset(self) -> None:
        """Forget every sequence: after a failed step the scheduler ends them all."""
        self.mirrors.clear()
        self.tables.reset()


