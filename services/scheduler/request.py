"""Requests and their sequences as the scheduler sees them.

A request is the unit of scheduling and preemption. It starts with one sequence holding the
prompt; with n > 1, best_of > 1 or beam search it forks into several sequences that share the
prompt's KV blocks.
"""

from __future__ import annotations

import enum
import time

from services.scheduler.beam_search import BeamSearch
from services.scheduler.in_flight import Flight
from services.scheduler.sequence_kv import SequenceKV
from shared.prefix_keys import salted_root
from shared.protocol import KVHandoff, LoraRef, SampledTokens
from shared.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not yet started, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # its blocks are in the worker's CPU swap space
    HELD = "held"  # a suspect of failing steps, waiting for its turn to run (services/scheduler/quarantine.py)
    FINISHED = "finished"


class Sequence:
    """Tokens and sampling state. Its KV state is the handle `kv`, which the KV cache manager owns."""

    __slots__ = (
        "seq_id",
        "request",
        "num_prompt_tokens",
        "index",
        "output_token_ids",
        "output_logprobs",
        "output_top_logprobs",
        "cumulative_logprob",
        "kv",
        "flight",
        "finish_reason",
    )

    def __init__(self, seq_id: int, request: Request, index: int, output_token_ids: list[int] | None = None):
        self.seq_id = seq_id
        self.request = request
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.index = index  # which sample of its request this is (seeds its draws)
        self.output_token_ids: list[int] = output_token_ids or []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        # Its computed positions may run past num_tokens, by what the steps in flight will bring (`flight`).
        self.kv = SequenceKV()
        self.flight = Flight()
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_coming(self) -> int:
        """Tokens the steps in flight may still give it (services/scheduler/in_flight.py)."""
        return self.flight.coming

    @property
    def num_pending(self) -> int:
        return self.flight.pending

    @property
    def num_drafts(self) -> int:
        return self.flight.drafts

    @property
    def num_speculative(self) -> int:
        return self.flight.speculative

    @property
    def num_tokens_known_to_worker(self) -> int:
        return self.flight.known_to_worker

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        if position < self.num_prompt_tokens:
            return self.request.prompt_token_ids[position]
        return self.output_token_ids[position - self.num_prompt_tokens]


class Request:
    __slots__ = (
        "request_id",
        "cache_root",
        "prompt_token_ids",
        "sampling",
        "arrival_time",
        "order",
        "forked",
        "status",
        "seqs",
        "finished_seqs",
        "beam",
        "beam_pending",
        "num_cached_prompt_tokens",
        "looked_up",
        "received",
        "first_scheduled",
        "prompt_logprobs",
        "prompt_top_logprobs",
        "prompt_logprobs_sent",
        "left_out_at",
        "priority",
        "tenant",
        "lora",
        "whole_prompt",
        "kv_send",
        "kv_source",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival_time: float,
        order: int = 0,
        cache_salt: str = "",
        priority: int = 0,
        tenant: str = "",
        received: float | None = None,
        lora: LoraRef | None = None,
    ):
        self.request_id = request_id
        self.lora = lora  # the adapter it runs under; None: the base model
        # Computed from its first position, nothing taken from the prefix cache: a prompt pooled over every token
        self.whole_prompt = False
        # The parent key of its first block in the prefix cache: no block is shared across salts or adapters.
        self.cache_root = salted_root(cache_salt, lora.key if lora is not None else "")
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.arrival_time = arrival_time
        self.order = order  # arrival order at the scheduler: every policy ranks by it last
        self.priority = priority
        self.tenant = tenant
        self.forked = False
        self.status = RequestStatus.WAITING
        self.seqs: list[Sequence] = []  # live sequences
        self.finished_seqs: list[Sequence] = []
        self.beam: BeamSearch | None = None  # when sampling.use_beam_search
        self.beam_pending: dict[int, SampledTokens] = {}  # seq_id -> what it sampled, until every beam has reported
        self.num_cached_prompt_tokens = 0
        self.looked_up = False  # in the prefix cache: counted once, however often it is recomputed
        self.received = time.monotonic() if received is None else received  # at the scheduler: queue time, aging
        # Results in when a step planned ahead first left it out, to start with later arrivals in the next step.
        self.left_out_at: int | None = None
        self.first_scheduled: float | None = None
        # With sampling.prompt_logprobs: per prompt position from 1 on, filled as steps compute them.
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_top_logprobs: list[dict[int, float]] = []
        if sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * (len(prompt_token_ids) - 1)
            self.prompt_top_logprobs = [{} for _ in range(len(prompt_token_ids) - 1)]
        self.prompt_logprobs_sent = False
        # Prefill/decode disaggregation (services/scheduler/remote_kv.py): keep the prompt's blocks for a decode
        # engine as it ends; or fetch them from a prefill engine first.
        self.kv_send = False
        self.kv_source: KVHandoff | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def forks_at_next_sample(self) -> bool:
        """Whether its next sample is n samples at once, which the scheduler forks it into."""
        return self.sampling.num_samples > 1 and not self.forked

    @property
    def num_seats(self) -> int:
        """Sequences this request counts against max_num_seqs: those it runs or will fork."""
        if self.sampling.use_beam_search or not self.forked:
            return self.sampling.num_samples
        return len(self.seqs)

    def __repr__(self) -> str:
        return f"Request({self.request_id}, {self.status.value}, seqs={[s.seq_id for s in self.seqs]})"
