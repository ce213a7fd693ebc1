"""Turn the last-position logits of each sequence into its next token(s).

Logits are first processed as the request asks (`logits_processing.py`: logit bias, min_tokens,
penalties, a grammar's mask). Greedy rows take the argmax. Sampled rows apply temperature, top-k, top-p and min-p,
then draw by
inverse CDF: one uniform number per sample, batched. A seeded request draws its number from a
generator reseeded from (seed, sample index, tokens generated so far), so its tokens do not
depend on what else is in the batch, nor on whether it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.worker.logits_processing import process_logits, processors
from services.worker.step_inputs import StepInputs
from shared.protocol import PromptLogprobs, ScheduledSequence
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from services.worker.mirrors import SequenceMirror
    from services.worker.models.base import PagedCausalLM


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    num_generated: int  # tokens this sequence had produced before this one
    index: int = 0  # the sequence's sample index within its request
    num_samples: int = 1  # > 1 when a finished prompt forks into best_of samples
    token_ids: list[int] = field(default_factory=list)  # prompt and output so far, for the penalties
    num_prompt_tokens: int = 0
    allowed: torch.Tensor | None = None  # with a grammar: the tokens it allows next, as a bitmask of int32 words


@dataclass(slots=True)
class Sample:
    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class Sampler:
    def __init__(self, seed: int, stop_ids: frozenset[int] = frozenset()):
        self.processors = processors(stop_ids)  # stop_ids: the model's EOS ids, held back before min_tokens
        self.unseeded = torch.Generator(device="cpu")
        self.unseeded.manual_seed(seed)
        self.seeded = torch.Generator(device="cpu")
        self.staging: dict[torch.device, tuple[StepInputs, StepInputs]] = {}  # (indices, values) per device

    def _staging(self, device: torch.device) -> tuple[StepInputs, StepInputs]:
        if device not in self.staging:
            self.staging[device] = StepInputs(device), StepInputs(device, torch.float32)
        return self.staging[device]

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[list[Sample]]:
        logits = logits.float()
        logits = process_logits(logits, rows, self.processors)
        owners = [i for i, row in enumerate(rows) for _ in range(row.num_samples)]
        draws = [k for row in rows for k in range(row.num_samples)]
        random_draws = [j for j, i in enumerate(owners) if not rows[i].params.greedy]
        random_owners = [owners[j] for j in random_draws]
        owner_index, random_index, random_owner_index = self._staging(logits.device)[0].load(
            owners, random_draws, random_owners
        )
        greedy = logits.argmax(dim=-1)
        choices = greedy[owner_index]
        if random_draws:
            choices[random_index] = self._draw(
                logits,
                rows,
                random_owners,
                random_owner_index,
                [draws[j] for j in random_draws],
                greedy[random_owner_index],
            )
        if any(row.params.first_token is not None and row.num_generated == 0 for row in rows):
            for j, i in enumerate(owners):  # a first token sampled elsewhere (a prefill engine's) is taken as it is
                if rows[i].params.first_token is not None and rows[i].num_generated == 0:
                    choices[j] = rows[i].params.first_token
        # Log-probabilities without the whole table, and only where someone reads them: the
        # exponentials cost more than the rest of sampling.
        chosen = None
        if any(row.params.needs_logprobs for row in rows):
            log_total = torch.logsumexp(logits, dim=-1)
            chosen = logits[owner_index, choices] - log_total[owner_index]
        chosen_ids: list[int] = choices.tolist()  # the step's one wait on the device: the rest is computed by now
        chosen_logprobs: list[float] = chosen.tolist() if chosen is not None else [0.0] * len(owners)
        num_top = max(row.params.num_top_logprobs for row in rows)
        top_ids: list[list[int]] = []
        top_values: list[list[float]] = []
        if num_top:
            values, ids = logits.topk(num_top, dim=-1)
            top_values, top_ids = (values - log_total[:, None]).tolist(), ids.tolist()
        samples: list[list[Sample]] = [[] for _ in rows]
        for j, i in enumerate(owners):
            k = rows[i].params.num_top_logprobs
            top: tuple[list[int], list[float]] = (top_ids[i][:k], top_values[i][:k]) if k else ([], [])
            samples[i].append(Sample(chosen_ids[j], chosen_logprobs[j], *top))
        return samples

    def _draw(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        owners: list[int],
        owner_index: torch.Tensor,
        draws: list[int],
        most_likely: torch.Tensor,
    ) -> torch.Tensor:
        """One batched draw, except that seeded rows take their uniform from their own reseeded
        generator so that batch company cannot change their tokens."""
        params = [rows[i].params for i in owners]
        picked = logits if owners == list(range(len(rows))) else logits[owner_index]
        uniform = torch.rand(len(owners), generator=self.unseeded)
        for j, (i, k) in enumerate(zip(owners, draws)):
            row = rows[i]
            if row.params.seed is not None:
                self.seeded.manual_seed(_mix(row.params.seed, row.index + k, row.num_generated))
                uniform[j] = torch.rand((), generator=self.seeded)
        values = self._staging(logits.device)[1]
        if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
            temperature, uniform = values.load([p.temperature for p in params], uniform)
            weights = torch.softmax(picked / temperature[:, None], dim=-1)  # what filtering would give
        else:
            *settings, uniform = values.load(*filter_settings(params, logits.shape[-1]), uniform)
            weights = filtered_probs(picked, *settings)
        cdf = weights.cumsum_(dim=-1)
        targets = uniform[:, None] * cdf[:, -1:]
        picks = torch.searchsorted(cdf, targets, right=True).clamp_(max=cdf.shape[-1] - 1)
        # Rounding can put a target at the very top, past every token: take the most likely one there.
        return torch.where(cdf.gather(1, picks) > targets, picks, most_likely[:, None]).squeeze(1)


def filter_settings(
    params: list[SamplingParams], vocab: int
) -> tuple[list[float], list[int], list[float], list[float]]:
    """Each row's temperature, top-k (the whole vocabulary where off), top-p and min-p."""
    return (
        [p.temperature for p in params],
        [p.top_k if p.top_k > 0 else vocab for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, one row per sequence (each setting
    one value per row, on the logits' device: `filter_settings`)."""
    device = logits.device
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]

    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p[:, None]
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)


def _mix(seed: int, index: int, counter: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0x94D049BB133111EB + counter * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def prompt_logprobs_of(
    model: PagedCausalLM, mirror: SequenceMirror, entry: ScheduledSequence, first_row: int, hidden: torch.Tensor
) -> PromptLogprobs:
    """How likely each prompt token a step computed for `entry` was (its hidden rows start at `first_row`)."""
    wanted = mirror.sampling.prompt_logprobs
    last = min(entry.start + entry.num_tokens, mirror.num_prompt_tokens - 1)  # positions predicting a prompt token
    rows = torch.arange(first_row, first_row + last - entry.start, device=hidden.device)
    logprobs = torch.log_softmax(model.logits(hidden[rows]).float(), dim=-1)
    targets = torch.tensor(mirror.token_ids[entry.start + 1 : last + 1], device=hidden.device)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    top_values, top_ids = logprobs.topk(wanted, dim=-1) if wanted else (logprobs[:, :0], logprobs[:, :0].long())
    return PromptLogprobs(entry.seq_id, entry.start + 1, chosen, top_ids.tolist(), top_values.tolist())
