"""Turn the last-position logits of each sequence into its next token.

Greedy rows take the argmax. Sampled rows apply temperature, top-k, top-p and min-p, then draw
with the exponential-race trick (argmax of p / E, E ~ Exp(1)). A seeded request draws E from its
own generator, reseeded from (seed, number of tokens generated so far), so its tokens do not
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


@dataclass(slots=True)
class Samples:
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class Sampler:
    def __init__(self, seed: int):
        self.unseeded = torch.Generator(device="cpu")
        self.unseeded.manual_seed(seed)
        self.seeded = torch.Generator(device="cpu")

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> Samples:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logits.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            probs = filtered_probs(logits[index], [rows[i].params for i in random_rows]).cpu()
            for j, i in enumerate(random_rows):
                chosen[i] = self._draw(probs[j], rows[i])
        token_ids = chosen.tolist()
        logprobs = raw_logprobs.gather(1, chosen[:, None])[:, 0].tolist()
        top_ids: list[list[int]] = []
        top_logprobs: list[list[float]] = []
        for i, row in enumerate(rows):
            k = row.params.logprobs or 0
            values, ids = raw_logprobs[i].topk(k) if k else (raw_logprobs[i][:0], chosen[:0])
            top_ids.append(ids.tolist())
            top_logprobs.append(values.tolist())
        return Samples(token_ids, logprobs, top_ids, top_logprobs)

    def _draw(self, probs: torch.Tensor, row: SampleRow) -> int:
        generator = self.unseeded
        if row.params.seed is not None:
            generator = self.seeded
            generator.manual_seed(_mix(row.params.seed, row.num_generated))
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


def _mix(seed: int, counter: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + counter * 0xBF58476D1CE4E5B9) % (2**63 - 1)
