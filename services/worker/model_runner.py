"""Execute one `Step`: update the per-sequence mirrors, run the model over the flattened batch,
and sample a token for every sequence whose tokens are now all computed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from services.worker.attention_metadata import AttentionMetadata
from services.worker.kv_cache import KVCache
from services.worker.sampler import SampleRow, Sampler
from shared.protocol import NewSequence, SampledToken, Step, StepResult
from shared.sampling import SamplingParams


@dataclass(slots=True)
class SequenceMirror:
    """The worker's copy of a sequence, kept between steps so steps carry only differences."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_table: list[int] = field(default_factory=list)


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
        for seq_id in step.finished_seq_ids + step.preempted_seq_ids:
            self.mirrors.pop(seq_id, None)
        for new in step.new_sequences:
            self.mirrors[new.seq_id] = _mirror_of(new)
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
            mirror.block_table.extend(entry.new_block_ids)
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

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=_pad(tables, self.device),
            query_start_loc=starts,
            context_lens=context_lens,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.cache.layers,
            meta,
        )
        last_rows = torch.tensor([starts[i + 1] - 1 for i in to_sample], device=self.device)
        logits = self.model.logits(hidden[last_rows])
        sampled_at = time.perf_counter()

        rows = []
        for i in to_sample:
            mirror = self.mirrors[step.scheduled[i].seq_id]
            rows.append(SampleRow(mirror.sampling, len(mirror.token_ids) - mirror.num_prompt_tokens))
        samples = self.sampler(logits, rows) if rows else None
        sampled = []
        for j, i in enumerate(to_sample):
            sampled.append(
                SampledToken(
                    step.scheduled[i].seq_id,
                    samples.token_ids[j],
                    samples.logprobs[j],
                    samples.top_ids[j],
                    samples.top_logprobs[j],
                )
            )
        done = time.perf_counter()
        return StepResult(
            step.step_id, sampled, (sampled_at - started) * 1e3, (done - sampled_at) * 1e3
        )

    def reset(self) -> None:
        """Forget every sequence: after a failed step the scheduler ends them all."""
        self.mirrors.clear()


def _mirror_of(new: NewSequence) -> SequenceMirror:
    return SequenceMirror(list(new.token_ids), new.num_prompt_tokens, new.sampling)


def _pad(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
