"""Turn the last-position logits of each sequence into its next token(s).

Greedy rows take the argmax. Sampled rows apply temperature, top-k, top-p and min-p, then draw
with the exponential-race trick (argmax of p / E, E ~ Exp(1)). A seeded request draws E from a
generator reseeded from (seed, sample index, tokens generated so far), so its tokens do not
depend on what else is in the batch, nor on whether it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.sampling import SamplingParams


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    num_generated: int  # tokens this sequence had produced before this one
    index: int = 0  # the sequence's sample index within its request
    num_samples: int = 1  # > 1 when a finished prompt forks into best_of samples


@dataclass(slots=True)
class Sample:
    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class Sampler:
    def __init__(self, seed: int):
        self.unseeded = torch.Generator(device="cpu")
        self.unseeded.manual_seed(seed)
        self.seeded = torch.Generator(device="cpu")

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[list[Sample]]:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        greedy = logits.argmax(dim=-1).tolist()
        choices: list[list[int]] = [[token] * row.num_samples for token, row in zip(greedy, rows)]
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            probs = filtered_probs(logits[index], [rows[i].params for i in random_rows]).cpu()
            for j, i in enumerate(random_rows):
                choices[i] = [self._draw(probs[j], rows[i], k) for k in range(rows[i].num_samples)]
        samples = []
        for i, row in enumerate(rows):
            k = row.params.num_top_logprobs
            top_values, top_ids = raw_logprobs[i].topk(k) if k else (None, None)
            top = (top_ids.tolist(), top_values.tolist()) if k else ([], [])
            chosen = raw_logprobs[i, choices[i]].tolist()
            samples.append([Sample(t, lp, *top) for t, lp in zip(choices[i], chosen)])
        return samples

    def _draw(self, probs: torch.Tensor, row: SampleRow, sample: int) -> int:
        generator = self.unseeded
        if row.params.seed is not None:
            generator = self.seeded
            generator.manual_seed(_mix(row.params.seed, row.index + sample, row.num_generated))
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / noise).argmax())


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
