"""Execute one `Step`: update the per-sequence mirrors, run the model over the flattened batch,
and sample a token for every sequence whose tokens are now all computed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kernels.batch import PagedBatch
from services.worker.kv_cache import KVCache
from services.worker.sampler import Sampler, SampleRow
from shared.protocol import NewSequence, SampledToken, Step, StepResult
from shared.sampling import SamplingParams


@dataclass(slots=True)
class SequenceMirror:
    """The worker's copy of a sequence, kept between steps so steps carry only differences."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    index: int
    block_table: list[int] = field(default_factory=list)

    def copy(self, index: int) -> SequenceMirror:
        return SequenceMirror(list(self.token_ids), self.num_prompt_tokens, self.sampling, index,
                              list(self.block_table))


class StepError(RuntimeError):
    pass


class ModelRunner:
    def __init__(self, model, cache: KVCache, device: torch.device, seed: int):
        self.model = model
        self.cache = cache
        self.device = device
        self.sampler = Sampler(seed)
        self.mirrors: dict[int, SequenceMirror] = {}

    @torch.inference_mode()
    def execute(self, step: Step) -> StepResult:
        started = time.perf_counter()
        for fork in step.forks:
            parent = self.mirrors.get(fork.parent_seq_id)
            if parent is None:
                raise StepError(f"step {step.step_id} forks unknown sequence {fork.parent_seq_id}")
            self.mirrors[fork.seq_id] = parent.copy(fork.index)
        for seq_id in step.finished_seq_ids + step.preempted_seq_ids:
            self.mirrors.pop(seq_id, None)
        for new in step.new_sequences:
            self.mirrors[new.seq_id] = _mirror_of(new)
        self.cache.finish_swaps()
        self.cache.swap_out(step.swap_out)
        self.cache.swap_in(step.swap_in)
        self.cache.copy_blocks(step.copies)
        if not step.scheduled:
            return StepResult(step.step_id, [], 0.0, 0.0)

        input_ids, positions, slots, starts, context_lens, tables = [], [], [], [0], [], []
        to_sample: list[int] = []
        block_size = self.cache.block_size
        for entry in step.scheduled:
            mirror = self.mirrors.get(entry.seq_id)
            if mirror is None:
                raise StepError(f"step {step.step_id} names unknown sequence {entry.seq_id}")
            mirror.token_ids.extend(entry.appended_token_ids)
            del mirror.block_table[entry.table_start :]
            mirror.block_table.extend(entry.block_ids)
            end = entry.start + entry.num_tokens
            if end > len(mirror.token_ids) or end > len(mirror.block_table) * block_size:
                raise StepError(f"sequence {entry.seq_id}: tokens or blocks missing for {end}")
            table = mirror.block_table
            for pos in range(entry.start, end):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            input_ids.extend(mirror.token_ids[entry.start : end])
            positions.extend(range(entry.start, end))
            starts.append(starts[-1] + entry.num_tokens)
            context_lens.append(end)
            tables.append(table)
            if end == len(mirror.token_ids):
                to_sample.append(len(starts) - 2)

        batch = PagedBatch.build(slots, tables, starts, context_lens, self.device)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.cache.layers,
            batch,
        )
        last_rows = torch.tensor([starts[i + 1] - 1 for i in to_sample], dtype=torch.int64, device=self.device)
        logits = self.model.logits(hidden[last_rows])
        sampled_at = time.perf_counter()

        rows = [self._sample_row(self.mirrors[step.scheduled[i].seq_id]) for i in to_sample]
        samples = self.sampler(logits, rows) if rows else []
        sampled = [
            SampledToken(step.scheduled[i].seq_id, s.token_id, s.logprob, s.top_ids, s.top_logprobs)
            for i, row_samples in zip(to_sample, samples)
            for s in row_samples
        ]
        done = time.perf_counter()
        return StepResult(
            step.step_id, sampled, (sampled_at - started) * 1e3, (done - sampled_at) * 1e3
        )

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
        return SampleRow(sampling, generated, mirror.index, sampling.num_samples if forks else 1)

    def reset(self) -> None:
        """Forget every sequence: after a failed step the scheduler ends them all."""
        self.mirrors.clear()


def _mirror_of(new: NewSequence) -> SequenceMirror:
    return SequenceMirror(list(new.token_ids), new.num_prompt_tokens, new.sampling, new.index)


