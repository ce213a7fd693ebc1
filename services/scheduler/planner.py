"""A step's budgets and what each request may take of them: the step being planned (`StepPlan`), a request's
wants (a prompt's chunk, or a decode's token and its proposals), and when a step planned ahead, while another
computes, holds back (`StepPlanner`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.admission import Budgets
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, Sequence
from services.scheduler.request_queue import RequestQueues
from services.scheduler.speculation import Speculation


@dataclass(slots=True)
class StepPlan:
    """The step being planned: what it runs and the tokens it has left, of all and of prompts (its block
    transfers are queued in the KV cache manager)."""

    tokens_left: int
    prompt_cap: int  # the policy's cap on the step's prompt tokens
    speculating: bool = False  # whether the step speculates (Speculation decides)
    prompt_tokens: int = 0  # taken
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, positions to compute)


def in_prompt(request: Request) -> bool:
    return any(seq.kv.num_computed < seq.num_prompt_tokens for seq in request.seqs)


class StepPlanner:
    def __init__(
        self, budgets: Budgets, kv_cache: KVCacheManager, queues: RequestQueues, speculation: Speculation | None
    ):
        self.budgets, self.kv_cache, self.queues, self.speculation = budgets, kv_cache, queues, speculation

    def prompt_heavy(self) -> bool:
        """Whether the next step would be mostly prompts. Under a policy that reorders such a step is not
        planned ahead: one already queued behind the step computing would delay a request arriving now
        that outranks it by a long step more, while planning it after costs the worker only the planning."""
        budget = self.budgets.max_num_batched_tokens
        tokens = sum(max(0, seq.num_prompt_tokens - seq.kv.num_computed) for seq in self.queues.running_sequences())
        seats = self.budgets.max_num_seqs - self.queues.num_running_seats()
        for request in self.queues.waiting:  # those that could start: as many as there are seats
            if 2 * tokens >= budget or request.num_seats > seats:
                break
            seats -= request.num_seats
            tokens += sum(seq.num_tokens for seq in request.seqs)
        return 2 * tokens >= budget

    def num_decoding(self) -> int:
        """Running sequences past their prompt: those a step that speculates gives proposals."""
        return sum(1 for seq in self.queues.running_sequences() if seq.kv.num_computed >= seq.num_prompt_tokens)

    def wants(self, request: Request, budget: int, plan: StepPlan) -> list[tuple[Sequence, int]]:
        """(sequence, positions) to compute for a request this step, within the token budget: a prompt's chunk,
        or a decode's last token and, in a step that speculates, its proposals, without the proposals where
        their blocks are not free (speculation never makes anyone wait or be preempted)."""
        wants: list[tuple[Sequence, int]] = []
        for seq in request.seqs:
            seq.flight.drop_drafts()
            if seq.num_pending and not self._runs_ahead(seq):
                continue
            n = seq.num_tokens + seq.num_coming - seq.kv.num_computed
            if n > budget:
                n = budget if self.budgets.chunked_prefill else 0
            if n == 1 and plan.speculating and self.speculation is not None:
                self.speculation.propose(seq, budget)
                n += seq.num_drafts
            if n > 0:
                wants.append((seq, n))
                budget -= n
        if not wants or self.kv_cache.can_append(wants):
            return wants
        fitted = []
        for seq, n in wants:
            fitted.append((seq, n - seq.num_drafts))
            seq.flight.drop_drafts()
        return fitted

    def _runs_ahead(self, seq: Sequence) -> bool:
        """Whether a sequence's next position may be scheduled before its pending sample is known:
        not if what the steps in flight may give it could be its last by length."""
        sampling = seq.request.sampling
        if sampling.use_beam_search or seq.request.forks_at_next_sample:
            return False
        return (
            len(seq.output_token_ids) + seq.num_coming < sampling.max_tokens
            and seq.num_tokens + seq.num_coming < self.budgets.max_model_len
        )

    def room(self, request: Request, plan: StepPlan) -> int:
        """The tokens a request may take in the step: for a prompt, within the policy's cap on prompt
        tokens too, except for the step's first prompt where prompts cannot be split into chunks."""
        if not in_prompt(request) or (plan.prompt_tokens == 0 and not self.budgets.chunked_prefill):
            return plan.tokens_left
        return max(0, min(plan.tokens_left, plan.prompt_cap - plan.prompt_tokens))

    def take(self, wants: list[tuple[Sequence, int]], plan: StepPlan) -> None:
        for seq, n in wants:
            if seq.kv.num_computed < seq.num_prompt_tokens:
                plan.prompt_tokens += n
            self.kv_cache.append_slots(seq, n)
            plan.scheduled.append((seq, n))
            plan.tokens_left -= n

    def prompts_fill(self, budget: int, results_in: int) -> bool:
        """Whether the waiting requests' prompts fill `budget` tokens.

        A step planned while another computes starts waiting requests only where they fill its budget,
        or where the first of them was left out while a step now done computed: otherwise it leaves them
        to the next step, which takes the requests that arrive meanwhile too. A burst of prompts (clients
        that all send at once, reaching the scheduler one by one) then runs in full steps rather than in
        one with the first few and more with the rest, each such step seconds long on a CPU; and no
        request waits more than one step so."""
        tokens = 0
        for request in self.queues.waiting:
            tokens += sum(seq.num_tokens for seq in request.seqs)
            if tokens >= budget:
                return True
        if self.queues.waiting and self.queues.waiting[0].left_out_at is None:
            self.queues.waiting[0].left_out_at = results_in
        return False

    def deferred(self, results_in: int) -> bool:
        """Whether the first waiting request was left out by a step planned ahead and a result came in since:
        left out until then, not only until the next plan, which the next arrival alone may prompt."""
        left_out_at = self.queues.waiting[0].left_out_at if self.queues.waiting else None
        return left_out_at is not None and results_in > left_out_at
