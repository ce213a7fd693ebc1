"""The policy: first-come-first-served continuous batching with preemption by recompute.

Each call to `schedule` decides one iteration: running sequences first (one token each for a
decode), then waiting ones in arrival order while the token, sequence and block budgets allow.
New sequences join at any step and finished ones leave at once. When a running sequence needs
a block and none is free, the latest-arrived running sequence is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed from its tokens.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from services.scheduler.block_manager import BlockManager
from services.scheduler.sequence import Sequence, Status
from shared.protocol import (
    AddRequest,
    NewSequence,
    RequestOutput,
    ScheduledSequence,
    SequenceDelta,
    Stats,
    Step,
    StepResult,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Budgets:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class Scheduler:
    def __init__(self, block_manager: BlockManager, budgets: Budgets, eos_token_ids: list[int]):
        self.block_manager = block_manager
        self.budgets = budgets
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.sequences: dict[int, Sequence] = {}
        self.by_request: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self._next_seq_id = 0
        self._dropped_on_worker: list[int] = []
        self._preempted_on_worker: list[int] = []

    # --- requests coming in --------------------------------------------------------------

    def add(self, request: AddRequest) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it can never run."""
        problem = self._admission_problem(request)
        if problem is not None:
            return _error_output(request.request_id, len(request.prompt_token_ids), problem, "rejected")
        seq = Sequence(
            self._next_seq_id,
            request.request_id,
            list(request.prompt_token_ids),
            request.sampling,
            request.arrival_time,
        )
        self._next_seq_id += 1
        self.sequences[seq.seq_id] = seq
        self.by_request[seq.request_id] = seq
        self.waiting.append(seq)
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.by_request.get(request_id)
        if seq is None:
            return None
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, "abort")
        return RequestOutput(
            request_id, seq.num_prompt_tokens, [SequenceDelta(0, [], [], [], "abort")], True
        )

    def _admission_problem(self, request: AddRequest) -> str | None:
        if request.request_id in self.by_request:
            return f"request id {request.request_id!r} is already in use"
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            return "the prompt is empty"
        if num_prompt >= self.budgets.max_model_len:
            return (
                f"the prompt has {num_prompt} tokens; this server's context is "
                f"{self.budgets.max_model_len} tokens"
            )
        if num_prompt > self.budgets.max_num_batched_tokens:
            return (
                f"the prompt has {num_prompt} tokens, more than max_num_batched_tokens "
                f"({self.budgets.max_num_batched_tokens})"
            )
        return None

    # --- one iteration -------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step | None:
        """Decide the next step, or None when there is nothing to run."""
        token_budget = self.budgets.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int, list[int]]] = []
        preempted_now = False

        running = list(self.running)
        while running:
            seq = running.pop(0)
            num_tokens = seq.num_uncomputed_tokens
            if num_tokens > token_budget:
                break
            while not self.block_manager.can_append(seq, num_tokens):
                victim = running.pop() if running else seq
                self._preempt(victim)
                preempted_now = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            scheduled.append((seq, num_tokens, self.block_manager.append_slots(seq, num_tokens)))
            token_budget -= num_tokens

        while self.waiting and not preempted_now:
            if len(self.running) >= self.budgets.max_num_seqs:
                break
            seq = self.waiting[0]
            num_tokens = seq.num_uncomputed_tokens
            if num_tokens > token_budget or not self.block_manager.can_allocate(seq, num_tokens):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append((seq, num_tokens, self.block_manager.append_slots(seq, num_tokens)))
            token_budget -= num_tokens

        if not scheduled:
            return None
        self.running.sort(key=lambda s: (s.arrival_time, s.seq_id))
        return self._build_step(scheduled)

    def _build_step(self, scheduled: list[tuple[Sequence, int, list[int]]]) -> Step:
        new_sequences: list[NewSequence] = []
        entries: list[ScheduledSequence] = []
        for seq, num_tokens, new_blocks in scheduled:
            known = seq.num_tokens_known_to_worker
            if known == 0:
                new_sequences.append(
                    NewSequence(seq.seq_id, seq.token_ids(), seq.num_prompt_tokens, seq.sampling)
                )
                appended: list[int] = []
            else:
                appended = seq.output_token_ids[known - seq.num_prompt_tokens :]
            seq.num_tokens_known_to_worker = seq.num_tokens
            entries.append(
                ScheduledSequence(seq.seq_id, seq.num_computed_tokens, num_tokens, appended, new_blocks)
            )
            seq.num_computed_tokens += num_tokens
        step = Step(
            self.num_steps,
            new_sequences,
            entries,
            self._dropped_on_worker,
            self._preempted_on_worker,
        )
        self._dropped_on_worker, self._preempted_on_worker = [], []
        self.num_steps += 1
        return step

    def _preempt(self, seq: Sequence) -> None:
        log.info("preempting sequence %d of %s by recompute", seq.seq_id, seq.request_id)
        self.block_manager.free(seq)
        self.running.remove(seq)
        if seq.num_tokens_known_to_worker:
            self._preempted_on_worker.append(seq.seq_id)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # --- results coming back -------------------------------------------------------------

    def update(self, result: StepResult) -> list[RequestOutput]:
        """Append the sampled tokens, apply the stop rules, and report what changed."""
        outputs = []
        for sampled in result.sampled:
            seq = self.sequences.get(sampled.seq_id)
            if seq is None or seq.status is not Status.RUNNING:
                continue  # aborted or preempted while the step ran
            seq.output_token_ids.append(sampled.token_id)
            finish_reason = self._stop_reason(seq, sampled.token_id)
            top = dict(zip(sampled.top_ids, sampled.top_logprobs))
            delta = SequenceDelta(0, [sampled.token_id], [sampled.logprob], [top], finish_reason)
            if finish_reason is not None:
                self._finish(seq, finish_reason)
            outputs.append(
                RequestOutput(seq.request_id, seq.num_prompt_tokens, [delta], finish_reason is not None)
            )
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request: the worker could not run a step."""
        outputs = []
        for seq in list(self.running) + list(self.waiting):
            if seq.status is Status.WAITING:
                self.waiting.remove(seq)
            self._finish(seq, "error")
            outputs.append(_error_output(seq.request_id, seq.num_prompt_tokens, error, "error"))
        return outputs

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        sampling = seq.sampling
        if token_id in self.eos_token_ids and not sampling.ignore_eos:
            return "stop"
        if token_id in sampling.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= sampling.max_tokens:
            return "length"
        if seq.num_tokens >= self.budgets.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        self.block_manager.free(seq)
        if seq.num_tokens_known_to_worker:
            self._dropped_on_worker.append(seq.seq_id)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        del self.sequences[seq.seq_id]
        del self.by_request[seq.request_id]

    def stats(self) -> Stats:
        return Stats(
            self.block_manager.num_blocks,
            self.block_manager.num_free_blocks,
            len(self.running),
            len(self.waiting),
            self.num_preemptions,
            self.num_steps,
        )


def _error_output(request_id: str, num_prompt_tokens: int, message: str, reason: str) -> RequestOutput:
    """`reason` is "rejected" for a request that can never run, "error" for a failure."""
    return RequestOutput(
        request_id, num_prompt_tokens, [SequenceDelta(0, [], [], [], reason)], True, message
    )
