"""Drive the scheduler without a worker: a stand-in that 'computes' steps like the real one."""

from __future__ import annotations

import itertools

from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Budgets, PreemptionPolicy, Scheduler
from shared.protocol import AddRequest, SampledToken, Step, StepResult
from shared.sampling import SamplingParams

EOS = 0


class StandInWorker:
    """Keeps each sequence's token count as a worker would, and samples `next_token(seq_id, n)`."""

    def __init__(self, next_token=lambda seq_id, position: 100 + position):
        self.next_token = next_token
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.steps: list[Step] = []

    def run(self, step: Step) -> StepResult:
        self.steps.append(step)
        for seq_id in step.finished_seq_ids + step.preempted_seq_ids:
            self.tokens.pop(seq_id, None)
            self.tables.pop(seq_id, None)
        for new in step.new_sequences:
            self.tokens[new.seq_id] = list(new.token_ids)
            self.tables[new.seq_id] = []
        sampled = []
        for entry in step.scheduled:
            tokens = self.tokens[entry.seq_id]
            tokens.extend(entry.appended_token_ids)
            del self.tables[entry.seq_id][entry.table_start :]
            self.tables[entry.seq_id].extend(entry.block_ids)
            end = entry.start + entry.num_tokens
            if end == len(tokens):
                token = self.next_token(entry.seq_id, len(tokens))
                sampled.append(SampledToken(entry.seq_id, token, -1.0, [], []))
        return StepResult(step.step_id, sampled, 0.0, 0.0)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=64, context=256,
                   num_cpu_blocks=0, preemption="recompute", prefix_caching=False, chunked=False):
    manager = BlockManager(num_blocks, block_size, num_cpu_blocks, watermark=0.0,
                           enable_prefix_caching=prefix_caching)
    budgets = Budgets(max_num_seqs, max_tokens_per_step, context, chunked_prefill=chunked)
    return Scheduler(manager, budgets, [EOS], PreemptionPolicy(preemption))


_ids = itertools.count()


def request(prompt_len=5, max_tokens=4, arrival=None, **sampling) -> AddRequest:
    n = next(_ids)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return AddRequest(f"req-{n}", list(range(1, prompt_len + 1)), params, float(arrival if arrival is not None else n))


def run_to_completion(scheduler: Scheduler, worker: StandInWorker, max_steps=10_000) -> dict[str, list]:
    """Step until idle; returns each request's outputs in order."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        step = scheduler.schedule()
        if step is None:
            break
        for output in scheduler.update(worker.run(step)):
            outputs.setdefault(output.request_id, []).append(output)
    return outputs
