"""Turn the last-position logits of each sequence into its next token(s).

Logits are first processed as the request asks (`logits_processing.py`: logit bias, min_tokens,
penalties, a grammar's mask). Greedy rows take the argmax. Sampled rows apply temperature, top-k, top-p and min-p, then draw by
inverse CDF: one uniform number per sample, batched. A seeded request draws its number from a
generator reseeded from (seed, sample index, tokens generated so far), so its tokens do not
depend on what else is in the batch, nor on whether it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.worker.logits_processing import process_logits, processors
from shared.sampling import SamplingParams


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

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[list[Sample]]:
        logits = logits.float()
        logits = process_logits(logits, rows, self.processors)
        owners = [i for i, row in enumerate(rows) for _ in range(row.num_samples)]
        draws = [k for row in rows for k in range(row.num_samples)]
        owner_index = torch.tensor(owners, dtype=torch.int64, device=logits.device)
        greedy = logits.argmax(dim=-1)
        choices = greedy[owner_index]
        random_draws = [j for j, i in enumerate(owners) if not rows[i].params.greedy]
        if random_draws:
            random_owners = [owners[j] for j in random_draws]
            choices[random_draws] = self._draw(logits, rows, random_owners, [draws[j] for j in random_draws],
                                               greedy[random_owners])
        # Log-probabilities without the whole table, and only where someone reads them: the
        # exponentials cost more than the rest of sampling.
        if any(row.params.needs_logprobs for row in rows):
            log_total = torch.logsumexp(logits, dim=-1)
            chosen = (logits[owner_index, choices] - log_total[owner_index]).tolist()
        else:
            chosen = [0.0] * len(owners)
        choices = choices.tolist()
        num_top = max(row.params.num_top_logprobs for row in rows)
        if num_top:
            top_values, top_ids = logits.topk(num_top, dim=-1)
            top_values, top_ids = (top_values - log_total[:, None]).tolist(), top_ids.tolist()
        samples: list[list[Sample]] = [[] for _ in rows]
        for j, i in enumerate(owners):
            k = rows[i].params.num_top_logprobs
            top = (top_ids[i][:k], top_values[i][:k]) if k else ([], [])
            samples[i].append(Sample(choices[j], chosen[j], *top))
        return samples

    def _draw(self, logits: torch.Tensor, rows: list[SampleRow], owners: list[int], draws: list[int],
              most_likely: torch.Tensor) -> torch.Tensor:
        """One batched draw, except that seeded rows take their uniform from their own reseeded
        generator so that batch company cannot change their tokens."""
        params = [rows[i].params for i in owners]
        picked = logits if owners == list(range(len(rows))) else logits[owners]
        if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
            temperature = torch.tensor([p.temperature for p in params], device=logits.device)
            weights = torch.softmax(picked / temperature[:, None], dim=-1)  # what filtering would give
        else:
            weights = filtered_probs(picked, params)
        cdf = weights.cumsum_(dim=-1)
        uniform = torch.rand(len(owners), generator=self.unseeded)
        for j, (i, k) in enumerate(zip(owners, draws)):
            row = rows[i]
            if row.params.seed is not None:
                self.seeded.manual_seed(_mix(row.params.seed, row.index + k, row.num_generated))
                uniform[j] = torch.rand((), generator=self.seeded)
        targets = uniform.to(cdf.device)[:, None] * cdf[:, -1:]
        picks = torch.searchsorted(cdf, targets, right=True).clamp_(max=cdf.shape[-1] - 1)
        # Rounding can put a target at the very top, past every token: take the most likely one there.
        return torch.where(cdf.gather(1, picks) > targets, picks, most_likely[:, None]).squeeze(1)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, one row per sequence."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)

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
